// Command meshcni-taint-controller keeps the taint cni.istio.io/not-ready:NoSchedule on
// every node whose meshcni agent pod is not Ready (a Deployment with leader election).
// See docs/taint.md.
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
