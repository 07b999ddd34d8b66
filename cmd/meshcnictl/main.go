// Command meshcnictl checks a cluster before and during a switch between Istio's
// istio-cni and meshcni (precheck), reports versions, explains what meshcni does to
// a pod and inspects a pod's live rules, renders, applies, checks and cleans the
// redirect rules by hand, and validates a pod's redirect from inside it (the
// validation init container). Its logic lives in pkg/.
package main

import (
	"os"
)

func main() {
	os.Exit(run(os.Args[1:]))
}
