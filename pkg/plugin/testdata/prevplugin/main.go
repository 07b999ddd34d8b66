// Command prevplugin is a test-only CNI plugin that stands first in a chain: ADD
// prints the result given in its configuration ("result"), converted to the
// configuration's cniVersion, so the next plugin gets it as prevResult. It touches
// nothing; DEL, CHECK, STATUS and GC succeed.
package main

import (
	"encoding/json"
	"fmt"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"
)

type conf struct {
	types.PluginConf
	Result json.RawMessage `json:"result"`
}

func add(args *skel.CmdArgs) error {
	var c conf
	if err := json.Unmarshal(args.StdinData, &c); err != nil {
		return fmt.Errorf("prevplugin: %w", err)
	}
	r, err := current.NewResult(c.Result)
	if err != nil {
		return fmt.Errorf("prevplugin: result: %w", err)
	}
	return types.PrintResult(r, c.CNIVersion)
}

func nop(*skel.CmdArgs) error { return nil }

func main() {
	skel.PluginMainFuncs(skel.CNIFuncs{Add: add, Del: nop, Check: nop, Status: nop, GC: nop}, version.All, "meshcni test prevplugin")
}
