package cniconf

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
)

// DefaultCNIVersion is the cniVersion of a standalone configuration list.
const DefaultCNIVersion = "1.0.0"

// Inject returns data (a configuration list, or a single configuration when isList is
// false, then converted to a list) with every meshcni entry removed and entry appended
// as the last plugin. Everything else keeps its order and content. fallbackName names
// the list when a single configuration has no name.
func Inject(data []byte, isList bool, fallbackName string, entry PluginEntry) ([]byte, error) {
	raw, err := entry.Marshal()
	if err != nil {
		return nil, err
	}
	list, plugins, err := toList(data, isList, fallbackName)
	if err != nil {
		return nil, err
	}
	kept, _, err := withoutMeshcni(plugins)
	if err != nil {
		return nil, err
	}
	kept = append(kept, raw)
	out, err := list.set("plugins", marshalArray(kept)).marshal()
	if err != nil {
		return nil, err
	}
	return out, nil
}

// Remove returns the configuration list data without its meshcni entries, and how
// many it removed. When it removed none, out is data unchanged.
func Remove(data []byte) (out []byte, removed int, err error) {
	list, plugins, err := toList(data, true, "")
	if err != nil {
		return nil, 0, err
	}
	kept, removed, err := withoutMeshcni(plugins)
	if err != nil || removed == 0 {
		return data, 0, err
	}
	out, err = list.set("plugins", marshalArray(kept)).marshal()
	return out, removed, err
}

// CheckEntry returns nil when data (a configuration list) holds exactly one meshcni
// entry, semantically equal to want.
func CheckEntry(data []byte, want PluginEntry) error {
	_, plugins, err := toList(data, true, "")
	if err != nil {
		return err
	}
	wantRaw, err := want.Marshal()
	if err != nil {
		return err
	}
	var wantV any
	if err := json.Unmarshal(wantRaw, &wantV); err != nil {
		return err
	}
	found := 0
	var mismatch error
	for _, p := range plugins {
		typ, err := pluginType(p)
		if err != nil {
			return err
		}
		if typ != PluginType {
			continue
		}
		found++
		var got any
		if err := json.Unmarshal(p, &got); err != nil {
			return err
		}
		if !reflect.DeepEqual(got, wantV) {
			mismatch = fmt.Errorf("meshcni entry differs: have %s, want %s", compact(p), wantRaw)
		}
	}
	switch {
	case found == 0:
		return ErrNoEntry
	case found > 1:
		return fmt.Errorf("%d meshcni entries, want one", found)
	}
	return mismatch
}

// ErrNoEntry: the configuration list has no meshcni entry.
var ErrNoEntry = errors.New("no meshcni entry")

// Standalone returns meshcni's own configuration list, named name.
func Standalone(name string, entry PluginEntry) ([]byte, error) {
	raw, err := entry.Marshal()
	if err != nil {
		return nil, err
	}
	nameRaw, err := json.Marshal(name)
	if err != nil {
		return nil, err
	}
	obj := object{
		{key: "cniVersion", value: json.RawMessage(`"` + DefaultCNIVersion + `"`)},
		{key: "name", value: nameRaw},
		{key: "plugins", value: marshalArray([]json.RawMessage{raw})},
	}
	return obj.marshal()
}

// toList parses data as a configuration list, or converts a single configuration to
// one: {"cniVersion", "name", "plugins": [the configuration as it was]}.
func toList(data []byte, isList bool, fallbackName string) (object, []json.RawMessage, error) {
	obj, err := parseObject(data)
	if err != nil {
		return nil, nil, err
	}
	if !isList {
		if typ, err := pluginType(data); err != nil || typ == "" {
			return nil, nil, errors.New("configuration has no type")
		}
		list := object{}
		if v, ok := obj.get("cniVersion"); ok {
			list = append(list, member{key: "cniVersion", value: v})
		}
		name, ok := obj.get("name")
		if !ok || string(name) == `""` {
			if name, err = json.Marshal(fallbackName); err != nil {
				return nil, nil, err
			}
		}
		list = append(list, member{key: "name", value: name})
		plugin := json.RawMessage(compact(data))
		return append(list, member{key: "plugins", value: marshalArray([]json.RawMessage{plugin})}), []json.RawMessage{plugin}, nil
	}
	var name string
	if v, ok := obj.get("name"); !ok || json.Unmarshal(v, &name) != nil {
		return nil, nil, errors.New("configuration list has no name")
	}
	pluginsRaw, ok := obj.get("plugins")
	if !ok {
		return nil, nil, errors.New("configuration list has no plugins")
	}
	var plugins []json.RawMessage
	if err := json.Unmarshal(pluginsRaw, &plugins); err != nil {
		return nil, nil, fmt.Errorf("configuration list plugins: %w", err)
	}
	if len(plugins) == 0 {
		return nil, nil, errors.New("configuration list has no plugins")
	}
	return obj, plugins, nil
}

func withoutMeshcni(plugins []json.RawMessage) (kept []json.RawMessage, removed int, err error) {
	for _, p := range plugins {
		typ, err := pluginType(p)
		if err != nil {
			return nil, 0, err
		}
		if typ == PluginType {
			removed++
			continue
		}
		kept = append(kept, p)
	}
	return kept, removed, nil
}

func pluginType(p json.RawMessage) (string, error) {
	var t struct {
		Type string `json:"type"`
	}
	if err := json.Unmarshal(p, &t); err != nil {
		return "", fmt.Errorf("plugin entry: %w", err)
	}
	return t.Type, nil
}

func compact(data []byte) []byte {
	var b bytes.Buffer
	if err := json.Compact(&b, data); err != nil {
		return data
	}
	return b.Bytes()
}
