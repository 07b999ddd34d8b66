package cniconf

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
)

var entry = PluginEntry{
	Type:              PluginType,
	PluginLogLevel:    "info",
	CNIAgentRunDir:    "/var/run/meshcni",
	ExcludeNamespaces: []string{"kube-system"},
	Backend:           "auto",
	Kubernetes:        Kubernetes{Kubeconfig: "/var/run/meshcni/meshcni-kubeconfig", CNIBinDir: "/opt/cni/bin"},
}

// The JSON names are the contract with the plugin.
func TestPluginEntryJSON(t *testing.T) {
	got, err := entry.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	const want = `{"type":"meshcni","plugin_log_level":"info","cni_agent_run_dir":"/var/run/meshcni","exclude_namespaces":["kube-system"],"backend":"auto","kubernetes":{"kubeconfig":"/var/run/meshcni/meshcni-kubeconfig","cni_bin_dir":"/opt/cni/bin"}}`
	if string(got) != want {
		t.Errorf("Marshal =\n%s\nwant\n%s", got, want)
	}
	var back PluginEntry
	if err := json.Unmarshal(got, &back); err != nil {
		t.Fatal(err)
	}
	if back.Kubernetes != entry.Kubernetes || back.Backend != entry.Backend {
		t.Errorf("round trip = %+v", back)
	}
}

func TestPluginEntryValidate(t *testing.T) {
	for _, tc := range []struct {
		name    string
		mutate  func(*PluginEntry)
		wantErr string
	}{
		{"ok", func(*PluginEntry) {}, ""},
		{"type", func(e *PluginEntry) { e.Type = "istio-cni" }, "type"},
		{"level", func(e *PluginEntry) { e.PluginLogLevel = "verbose" }, "plugin_log_level"},
		{"backend", func(e *PluginEntry) { e.Backend = "ebpf" }, "backend"},
		{"relative run dir", func(e *PluginEntry) { e.CNIAgentRunDir = "run/meshcni" }, "cni_agent_run_dir"},
		{"unclean kubeconfig", func(e *PluginEntry) { e.Kubernetes.Kubeconfig = "/var/run/../x" }, "kubeconfig"},
		{"namespace", func(e *PluginEntry) { e.ExcludeNamespaces = []string{"Kube_System"} }, "exclude_namespaces"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := entry
			tc.mutate(&e)
			err := e.Validate()
			if (err == nil) != (tc.wantErr == "") || (err != nil && !strings.Contains(err.Error(), tc.wantErr)) {
				t.Errorf("Validate() = %v, want error containing %q", err, tc.wantErr)
			}
		})
	}
}

func TestInjectRemoveCheck(t *testing.T) {
	for _, tc := range []struct {
		name    string
		in      string
		isList  bool
		wantErr string
		want    string // compact
	}{
		{name: "list", isList: true,
			in:   `{"z":1,"name":"n","plugins":[{"type":"a","x":{"b":1,"a":2}}],"a":"<&>"}`,
			want: `{"z":1,"name":"n","plugins":[{"type":"a","x":{"b":1,"a":2}},` + mustMarshal(t) + `],"a":"<&>"}`},
		{name: "conf", isList: false,
			in:   `{"type":"bridge","cniVersion":"0.4.0","name":"br"}`,
			want: `{"cniVersion":"0.4.0","name":"br","plugins":[{"type":"bridge","cniVersion":"0.4.0","name":"br"},` + mustMarshal(t) + `]}`},
		{name: "conf without name", isList: false,
			in:   `{"type":"bridge"}`,
			want: `{"name":"fallback","plugins":[{"type":"bridge"},` + mustMarshal(t) + `]}`},
		{name: "replaces old entries", isList: true,
			in:   `{"name":"n","plugins":[{"type":"meshcni","old":1},{"type":"a"},{"type":"meshcni"}]}`,
			want: `{"name":"n","plugins":[{"type":"a"},` + mustMarshal(t) + `]}`},
		{name: "not json", isList: true, in: `{"name":`, wantErr: "parse JSON"},
		{name: "trailing data", isList: true, in: `{"name":"n","plugins":[{"type":"a"}]} {}`, wantErr: "after the top-level"},
		{name: "array", isList: true, in: `[]`, wantErr: "not an object"},
		{name: "no plugins", isList: true, in: `{"name":"n"}`, wantErr: "no plugins"},
		{name: "empty plugins", isList: true, in: `{"name":"n","plugins":[]}`, wantErr: "no plugins"},
		{name: "plugins not array", isList: true, in: `{"name":"n","plugins":{}}`, wantErr: "plugins"},
		{name: "no name", isList: true, in: `{"plugins":[{"type":"a"}]}`, wantErr: "no name"},
		{name: "conf without type", isList: false, in: `{"name":"n"}`, wantErr: "no type"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, err := Inject([]byte(tc.in), tc.isList, "fallback", entry)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("Inject error = %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := string(compact(out)); got != tc.want {
				t.Errorf("Inject =\n%s\nwant\n%s", got, tc.want)
			}
			if err := CheckEntry(out, entry); err != nil {
				t.Errorf("CheckEntry after Inject: %v", err)
			}
			other := entry
			other.Backend = "nftables"
			if err := CheckEntry(out, other); err == nil || errors.Is(err, ErrNoEntry) {
				t.Errorf("CheckEntry with another entry = %v, want a mismatch", err)
			}
			removed, n, err := Remove(out)
			if err != nil || n != 1 {
				t.Fatalf("Remove = %d, %v", n, err)
			}
			if err := CheckEntry(removed, entry); !errors.Is(err, ErrNoEntry) {
				t.Errorf("CheckEntry after Remove = %v, want ErrNoEntry", err)
			}
			same, n, err := Remove(removed)
			if err != nil || n != 0 || string(same) != string(removed) {
				t.Errorf("second Remove = %d, %v, changed=%v", n, err, string(same) != string(removed))
			}
		})
	}
}

func mustMarshal(t *testing.T) string {
	b, err := entry.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestStandalone(t *testing.T) {
	out, err := Standalone("meshcni", entry)
	if err != nil {
		t.Fatal(err)
	}
	want := `{"cniVersion":"1.0.0","name":"meshcni","plugins":[` + mustMarshal(t) + `]}`
	if got := string(compact(out)); got != want {
		t.Errorf("Standalone =\n%s\nwant\n%s", got, want)
	}
}
