package main

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestNodePluginConfig(t *testing.T) {
	entry := `{"type":"meshcni","cni_agent_run_dir":"/var/run/meshcni","exclude_namespaces":["batch"],"agent_pod_label":"app=agent","kubernetes":{"exclude_namespaces":["legacy"]}}`
	for _, tc := range []struct {
		name      string
		files     map[string]string
		wantFile  string
		wantExcl  string
		wantLabel string
		wantErr   string
		errIs     error
	}{
		{name: "chained entry", files: map[string]string{
			"10-primary.conflist": `{"cniVersion":"1.0.0","name":"k8s","plugins":[{"type":"bridge"},` + entry + `]}`,
		}, wantFile: "10-primary.conflist", wantExcl: "batch,legacy", wantLabel: "app=agent"},
		{name: "first file in kubelet's order wins; unparsable files skipped", files: map[string]string{
			"05-broken.conflist":  `{not json`,
			"10-primary.conflist": `{"cniVersion":"1.0.0","name":"k8s","plugins":[{"type":"bridge"},` + entry + `]}`,
			"20-other.conflist":   `{"cniVersion":"1.0.0","name":"o","plugins":[{"type":"meshcni","cni_agent_run_dir":"/x","exclude_namespaces":["other"]}]}`,
		}, wantFile: "10-primary.conflist", wantExcl: "batch,legacy", wantLabel: "app=agent"},
		{name: "standalone list", files: map[string]string{
			"meshcni.conflist": `{"cniVersion":"1.0.0","name":"meshcni","plugins":[{"type":"meshcni","cni_agent_run_dir":"/x"}]}`,
		}, wantFile: "meshcni.conflist", wantExcl: "", wantLabel: "app.kubernetes.io/name=meshcni"},
		{name: "no entry", files: map[string]string{
			"10-primary.conflist": `{"cniVersion":"1.0.0","name":"k8s","plugins":[{"type":"bridge"}]}`,
		}, errIs: errNoEntry},
		{name: "bad entry is an error naming the file", files: map[string]string{
			"10-primary.conflist": `{"cniVersion":"1.0.0","name":"k8s","plugins":[{"type":"meshcni","cni_agent_run_dir":"/x","backend":"ebpf"}]}`,
		}, wantErr: "10-primary.conflist"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			for name, data := range tc.files {
				if err := os.WriteFile(filepath.Join(dir, name), []byte(data), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			cfg, file, err := nodePluginConfig(dir)
			switch {
			case tc.errIs != nil:
				if !errors.Is(err, tc.errIs) {
					t.Fatalf("error %v, want %v", err, tc.errIs)
				}
				return
			case tc.wantErr != "":
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("error %v, want one naming %s", err, tc.wantErr)
				}
				return
			case err != nil:
				t.Fatal(err)
			}
			if filepath.Base(file) != tc.wantFile || strings.Join(cfg.ExcludeNamespaces, ",") != tc.wantExcl || cfg.AgentLabel.String() != tc.wantLabel {
				t.Fatalf("got %s excl=%v label=%s, want %s excl=%s label=%s", file, cfg.ExcludeNamespaces, cfg.AgentLabel, tc.wantFile, tc.wantExcl, tc.wantLabel)
			}
		})
	}
	if _, _, err := nodePluginConfig(filepath.Join(t.TempDir(), "absent")); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("missing dir: %v, want fs.ErrNotExist", err)
	}
}
