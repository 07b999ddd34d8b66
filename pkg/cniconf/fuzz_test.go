package cniconf

import (
	"bytes"
	"encoding/json"
	"testing"
)

// others returns the compacted non-meshcni plugins of a configuration list as libcni
// reads it: libcni.NetworkConfFromBytes decodes the list into a map and takes the
// exact key "plugins" (the last duplicate wins), then each plugin's type with
// encoding/json into a struct.
func others(t *testing.T, data []byte) (kept []string, meshcni int, last string) {
	t.Helper()
	var l map[string]json.RawMessage
	var plugins []json.RawMessage
	if err := json.Unmarshal(data, &l); err != nil {
		t.Fatalf("output is not a configuration list: %v\n%s", err, data)
	}
	if err := json.Unmarshal(l["plugins"], &plugins); err != nil {
		t.Fatalf("output's plugins: %v\n%s", err, data)
	}
	for _, p := range plugins {
		typ, err := pluginType(p)
		if err != nil {
			t.Fatalf("plugin %s: %v", p, err)
		}
		if typ == PluginType {
			meshcni++
		} else {
			kept = append(kept, string(compact(p)))
		}
		last = typ
	}
	return kept, meshcni, last
}

func equal(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// FuzzInjectRemove: for any input Inject accepts, the result (as libcni reads it)
// holds the other plugins unchanged and in order, then exactly one meshcni entry,
// last, equal to the one injected; Inject is idempotent; Remove then gives back the
// other plugins unchanged with no meshcni entry. Invalid input is an error.
func FuzzInjectRemove(f *testing.F) {
	for _, s := range []string{
		`{"cniVersion":"1.0.0","name":"k8s-pod-network","plugins":[{"type":"calico","ipam":{"type":"calico-ipam"}},{"type":"portmap","capabilities":{"portMappings":true}}]}`,
		`{"name":"n","plugins":[{"type":"bridge"},{"type":"meshcni","x":1},{"type":"meshcni"},{"type":"tuning","z":[1,2,{"a":null}]}],"extra":{"keep":"me"}}`,
		`{"cniVersion":"0.3.1","name":"single","type":"flannel","delegate":{"isDefaultGateway":true}}`,
		`{"type":"ptp","ipam":{"type":"host-local","subnet":"10.0.0.0/24"}}`,
		`{"name":"dup","name":"dup2","plugins":[{"type":"a"}],"plugins":[{"type":"b"}]}`,
		`{"name":"case","plugins":[{"type":"a"}],"Plugins":[{"type":"b"}]}`,
		`{"name":"t","plugins":[{"Type":"meshcni"},{"type":"x","TYPE":"meshcni"}]}`,
		`{"name":"n","plugins":[]}`, `{"name":"n","plugins":[1]}`, `{"name":1,"plugins":[{}]}`, `[]`, `{}`, `{"a":1} {}`, `{"name":"\u00e9\ud800","plugins":[{"type":"b\n"}]}`,
	} {
		f.Add([]byte(s), true)
		f.Add([]byte(s), false)
	}
	wantEntry, err := entry.Marshal()
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, data []byte, isList bool) {
		out, err := Inject(data, isList, "fallback", entry)
		if err != nil {
			return
		}
		var before []string
		if isList {
			before, _, _ = others(t, data)
		} else if typ, _ := pluginType(data); typ != PluginType {
			before = []string{string(compact(data))}
		}
		after, n, last := others(t, out)
		if !equal(before, after) || n != 1 || last != PluginType {
			t.Fatalf("Inject: other plugins\n%q\nbecame\n%q\n(%d meshcni entries, last type %q)\n%s", before, after, n, last, out)
		}
		if err := CheckEntry(out, entry); err != nil {
			t.Fatalf("CheckEntry after Inject: %v\n%s", err, out)
		}
		again, err := Inject(out, true, "fallback", entry)
		if err != nil || !bytes.Equal(again, out) {
			t.Fatalf("Inject is not idempotent (%v):\n%s\nthen\n%s", err, out, again)
		}
		removed, k, err := Remove(out)
		if err != nil || k != 1 {
			t.Fatalf("Remove after Inject: %d removed, %v", k, err)
		}
		rest, n, _ := others(t, removed)
		if !equal(before, rest) || n != 0 {
			t.Fatalf("Remove: other plugins\n%q\nbecame\n%q (%d meshcni entries)", before, rest, n)
		}
		if bytes.Contains(removed, wantEntry) {
			t.Fatalf("Remove left meshcni's entry:\n%s", removed)
		}
	})
}
