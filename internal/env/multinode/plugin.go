package multinode

import (
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/tools/build/image"
)

// PluginState is meshcni's plugin on one node, as the host reads the node's CNI
// directories.
type PluginState struct {
	// Binary: the plugin binary of the installed build is in the node's CNI bin
	// directory; AnyBinary: a file of the plugin's name is.
	Binary, AnyBinary bool
	// Conflist is the node's primary CNI configuration file (the first by name,
	// as the runtime picks it); Entries counts its plugins of type meshcni.
	Conflist string
	Entries  int
	// Err: the configuration could not be read or is not a valid conflist.
	Err error
}

func (s PluginState) String() string {
	if s.Err != nil {
		return s.Err.Error()
	}
	return fmt.Sprintf("%d meshcni entries in %s", s.Entries, s.Conflist)
}

// Plugin reads the plugin's state on node n.
func (c *Cluster) Plugin(n *testbed.Node) PluginState {
	var st PluginState
	sha, err := fileSHA(filepath.Join(n.CNIBinDir(), image.PluginCommand))
	st.AnyBinary = err == nil
	st.Binary = err == nil && sha == c.pluginSHA
	st.Conflist, st.Entries, st.Err = ConflistEntries(n.CNIConfDir())
	return st
}

// ConflistEntries finds the primary CNI configuration in dir (the first .conflist,
// .conf or .json by name) and counts its meshcni entries; an error when there is
// none, it cannot be read, or it is not a conflist with a plugins list.
func ConflistEntries(dir string) (file string, entries int, err error) {
	des, err := os.ReadDir(dir)
	if err != nil {
		return "", 0, err
	}
	var names []string
	for _, de := range des {
		if ext := filepath.Ext(de.Name()); !de.IsDir() && (ext == ".conflist" || ext == ".conf" || ext == ".json") {
			names = append(names, de.Name())
		}
	}
	if len(names) == 0 {
		return "", 0, fmt.Errorf("no CNI configuration in %s", dir)
	}
	slices.Sort(names)
	file = filepath.Join(dir, names[0])
	b, err := os.ReadFile(file)
	if err != nil {
		return file, 0, err
	}
	var conf struct {
		Name    string `json:"name"`
		Plugins []struct {
			Type string `json:"type"`
		} `json:"plugins"`
	}
	if err := json.Unmarshal(b, &conf); err != nil {
		return file, 0, fmt.Errorf("%s is not valid JSON: %w", file, err)
	}
	if conf.Name == "" || len(conf.Plugins) == 0 {
		return file, 0, fmt.Errorf("%s is not a conflist (name %q, %d plugins)", file, conf.Name, len(conf.Plugins))
	}
	for i, p := range conf.Plugins {
		if p.Type == "" {
			return file, 0, fmt.Errorf("%s: plugin %d has no type", file, i)
		}
		if p.Type == image.PluginCommand {
			entries++
		}
	}
	return file, entries, nil
}

func fileSHA(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("%x", sha256.Sum256(b)), nil
}

// errList joins problems into one error (nil when none).
func errList(problems []string) error {
	if len(problems) == 0 {
		return nil
	}
	return errors.New(strings.Join(problems, "; "))
}
