// Command meshcni is the meshcni CNI plugin (see pkg/plugin).
package main

import "github.com/meshcni/meshcni/pkg/plugin"

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

func main() { plugin.Main(version) }
