// Command meshcnictl renders, applies, checks and cleans meshcni's traffic-redirect
// rules by hand, validates a pod's redirect from inside it (the validation init
// container), explains what meshcni would do to a pod and inspects a pod's live rules.
package main

import (
	"os"
)

func main() {
	os.Exit(run(os.Args[1:]))
}
