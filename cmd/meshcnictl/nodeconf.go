package main

import (
	"encoding/json"
	"errors"
	"fmt"

	"github.com/meshcni/meshcni/pkg/cniconf"
	"github.com/meshcni/meshcni/pkg/install"
	"github.com/meshcni/meshcni/pkg/plugin"
)

// errNoEntry: no configuration file of the directory holds a meshcni entry.
var errNoEntry = errors.New("no meshcni entry")

// nodePluginConfig finds meshcni's entry in the node's CNI configuration directory
// (the files kubelet would try, in its order; the first entry wins) and parses it
// as the plugin does, so inspect decides with the plugin's own exclude_namespaces,
// agent_pod_namespace and agent_pod_label. It returns the file the entry came from.
func nodePluginConfig(dir string) (*plugin.Config, string, error) {
	files, err := install.ListFiles(dir)
	if err != nil {
		return nil, "", err
	}
	for _, file := range files {
		data, err := install.ReadConfig(file)
		if errors.Is(err, install.ErrUnloadable) {
			continue // a FIFO, a device or an oversized file: kubelet cannot load it either
		}
		if err != nil {
			return nil, "", fmt.Errorf("read %s: %w", file, err)
		}
		var doc struct {
			CNIVersion string            `json:"cniVersion"`
			Type       string            `json:"type"`
			Plugins    []json.RawMessage `json:"plugins"`
		}
		if json.Unmarshal(data, &doc) != nil {
			continue // kubelet skips what it cannot parse too
		}
		entries := doc.Plugins
		if doc.Type == cniconf.PluginType {
			entries = []json.RawMessage{data}
		}
		for _, raw := range entries {
			var head struct {
				Type string `json:"type"`
			}
			if json.Unmarshal(raw, &head) != nil || head.Type != cniconf.PluginType {
				continue
			}
			cfg, err := plugin.ParseConfig(raw)
			if err != nil {
				return nil, file, fmt.Errorf("meshcni entry in %s: %w", file, err)
			}
			return cfg, file, nil
		}
	}
	return nil, "", fmt.Errorf("%w in %s", errNoEntry, dir)
}
