// Command meshcni-podget GETs one pod from the Kubernetes API for the meshcni CNI
// plugin, which runs it when the node agent cannot answer (see pkg/podget and
// pkg/podget/helper). It is installed next to the plugin in the CNI bin directory.
package main

import (
	"os"

	"github.com/meshcni/meshcni/pkg/podget/helper"
)

func main() { os.Exit(helper.Main(os.Args[1:], os.Stdout, os.Stderr, os.Getenv)) }
