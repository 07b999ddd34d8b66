// Command meshcni-taint-controller keeps the taint cni.istio.io/not-ready:NoSchedule on
// every node whose meshcni agent pod is not Ready (a Deployment with leader election).
// See docs/taint.md.
package main

import (
	"os"

	"github.com/meshcni/meshcni/pkg/taint"
)

func main() {
	os.Exit(taint.Main(os.Args[1:], os.Getenv, os.Stderr))
}
