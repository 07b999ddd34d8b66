// Command meshcni-taint-controller puts the taint cni.istio.io/not-ready:NoSchedule on a
// node whose meshcni agent pod is not Ready (by default only a joining node, whose agent
// was never Ready there; never more than --max-tainted-fraction of the nodes) and
// removes it once the agent pod is Ready (a Deployment with leader election). See
// docs/taint.md.
package main

import (
	"os"

	"github.com/meshcni/meshcni/pkg/taint"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

func main() {
	os.Exit(taint.MainVersion(version, os.Args[1:], os.Getenv, os.Stderr))
}
