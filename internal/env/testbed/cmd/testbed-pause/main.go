// Command testbed-pause is the test bed's sandbox ("pause") image: it blocks until
// SIGINT or SIGTERM and exits 0.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	c := make(chan os.Signal, 1)
	signal.Notify(c, syscall.SIGINT, syscall.SIGTERM)
	<-c
}
