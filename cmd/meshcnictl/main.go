// Command meshcnictl renders, applies, checks and cleans meshcni's traffic-redirect
// rules by hand, validates a pod's redirect from inside it, and explains pods.
package main

import (
	"os"
)

func main() {
	os.Exit(run(os.Args[1:]))
}
