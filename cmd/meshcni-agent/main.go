// Command meshcni-agent is meshcni's node agent (a DaemonSet): it installs the meshcni
// CNI plugin on its node, guards it, and serves health, metrics and the plugin socket.
// See docs/agent.md.
package main

import (
	"os"

	"github.com/meshcni/meshcni/pkg/agent"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

func main() {
	os.Exit(agent.MainVersion(version, os.Args[1:], os.Getenv, os.Stderr))
}
