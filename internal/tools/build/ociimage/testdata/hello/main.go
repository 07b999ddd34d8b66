// Command hello is a test program for GoBinary.
package main

import "fmt"

func main() { fmt.Println("hello") }
