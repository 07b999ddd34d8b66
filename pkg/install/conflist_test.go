package install

import (
	"bytes"
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/meshcni/meshcni/internal/testkit/golden"
	"github.com/meshcni/meshcni/pkg/cniconf"
)

// TestEntry is the plugin entry every golden case is written with.
var testEntry = cniconf.PluginEntry{
	Type:              cniconf.PluginType,
	PluginLogLevel:    "info",
	CNIAgentRunDir:    "/var/run/meshcni",
	ExcludeNamespaces: []string{"kube-system"},
	Backend:           "auto",
	Kubernetes: cniconf.Kubernetes{
		Kubeconfig: "/var/run/meshcni/meshcni-kubeconfig",
		CNIBinDir:  "/opt/cni/bin",
	},
}

type caseOptions struct {
	Chained     *bool  `json:"chained"`
	FileName    string `json:"file_name"`
	NetworkName string `json:"network_name"`
	// UninstallLeaves are lists Uninstall leaves alone and names in an ErrInvalid:
	// they do not parse, so may hold an entry it cannot see.
	UninstallLeaves []string `json:"uninstall_leaves"`
}

func loadCase(t *testing.T, dir string) (ConflistOptions, caseOptions) {
	t.Helper()
	o := ConflistOptions{Chained: true, Entry: testEntry}
	data, err := os.ReadFile(filepath.Join(dir, "options.json"))
	if errors.Is(err, fs.ErrNotExist) {
		return o, caseOptions{}
	}
	if err != nil {
		t.Fatal(err)
	}
	var co caseOptions
	if err := json.Unmarshal(data, &co); err != nil {
		t.Fatalf("%s/options.json: %v", dir, err)
	}
	if co.Chained != nil {
		o.Chained = *co.Chained
	}
	o.FileName = co.FileName
	o.NetworkName = co.NetworkName
	return o, co
}

func copyDir(t *testing.T, src, dst string) {
	t.Helper()
	ents, err := os.ReadDir(src)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		data, err := os.ReadFile(filepath.Join(src, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dst, e.Name()), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func readDir(t *testing.T, dir string) map[string]string {
	t.Helper()
	files := map[string]string{}
	ents, err := os.ReadDir(dir)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		t.Fatal(err)
	}
	for _, e := range ents {
		data, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		files[e.Name()] = string(data)
	}
	return files
}

// compareGolden compares the files of dir with the golden directory both ways (a
// file missing from either side fails), or rewrites it under -update.
func compareGolden(t *testing.T, dir, goldenDir string) {
	t.Helper()
	got := readDir(t, dir)
	names := make([]string, 0, len(got))
	for name := range got {
		names = append(names, name)
	}
	sort.Strings(names)
	d := golden.Open(t, goldenDir)
	for _, name := range names {
		d.CheckString(t, name, got[name])
	}
}

func cases(t *testing.T) []string {
	t.Helper()
	ents, err := os.ReadDir("testdata")
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		if e.IsDir() {
			names = append(names, e.Name())
		}
	}
	return names
}

// Every directory shape: before → Install → after → Install again (no change) →
// Uninstall → uninstalled.
func TestInstallGolden(t *testing.T) {
	for _, name := range cases(t) {
		t.Run(name, func(t *testing.T) {
			tc := filepath.Join("testdata", name)
			o, co := loadCase(t, tc)
			o.Dir = t.TempDir()
			copyDir(t, filepath.Join(tc, "before"), o.Dir)

			res, err := InstallConflist(o)
			if err != nil {
				t.Fatalf("Install: %v", err)
			}
			compareGolden(t, o.Dir, filepath.Join(tc, "after"))
			if path, err := CheckConflist(o); err != nil || path != res.Path {
				t.Errorf("Check after Install = %q, %v; want %q, nil", path, err, res.Path)
			}
			for _, s := range res.Skipped {
				t.Logf("skipped %s: %v", filepath.Base(s.Path), s.Err)
			}

			again, err := InstallConflist(o)
			if err != nil || again.Changed || again.Missing {
				t.Errorf("second Install = %+v, %v; want no change", again, err)
			}

			_, err = UninstallConflist(o)
			switch {
			case len(co.UninstallLeaves) == 0 && err != nil:
				t.Fatalf("Uninstall: %v", err)
			case len(co.UninstallLeaves) > 0 && !errors.Is(err, ErrInvalid):
				t.Fatalf("Uninstall error = %v, want ErrInvalid naming %v", err, co.UninstallLeaves)
			}
			for _, name := range co.UninstallLeaves {
				if !strings.Contains(err.Error(), name) {
					t.Errorf("Uninstall error %q does not name %s", err, name)
				}
			}
			compareGolden(t, o.Dir, filepath.Join(tc, "uninstalled"))
			if _, err := CheckConflist(o); err == nil {
				t.Error("Check after Uninstall: nil error, want one")
			}
		})
	}
}

func TestInstallKeepsMode(t *testing.T) {
	for _, tc := range []struct {
		file string
		mode fs.FileMode
	}{
		{"10-a.conflist", 0o600},
		{"10-a.conf", 0o640},
	} {
		t.Run(tc.file, func(t *testing.T) {
			dir := t.TempDir()
			data := `{"cniVersion":"1.0.0","name":"a","plugins":[{"type":"bridge"}]}`
			if strings.HasSuffix(tc.file, ".conf") {
				data = `{"cniVersion":"1.0.0","name":"a","type":"bridge"}`
			}
			p := filepath.Join(dir, tc.file)
			if err := os.WriteFile(p, []byte(data), tc.mode); err != nil {
				t.Fatal(err)
			}
			res, err := InstallConflist(ConflistOptions{Dir: dir, Chained: true, Entry: testEntry})
			if err != nil {
				t.Fatal(err)
			}
			fi, err := os.Stat(res.Path)
			if err != nil {
				t.Fatal(err)
			}
			if fi.Mode().Perm() != tc.mode {
				t.Errorf("mode of %s = %v, want %v", res.Path, fi.Mode().Perm(), tc.mode)
			}
		})
	}
}

// Bad input: a clear error and nothing written.
func TestInstallBadInput(t *testing.T) {
	notDir := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(notDir, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	bad := testEntry
	bad.Backend = "ebpf"
	for _, tc := range []struct {
		name    string
		files   map[string]string
		dir     string
		file    string
		entry   *cniconf.PluginEntry
		wantErr string
		noPrim  bool
	}{
		{name: "empty dir", noPrim: true, wantErr: "no primary CNI configuration"},
		{name: "missing dir", dir: "/nonexistent/meshcni-test", wantErr: "no such file or directory"},
		{name: "dir is a file", dir: notDir, wantErr: "not a directory"},
		{name: "only invalid files", files: map[string]string{"10-a.conflist": `{"name":`, "20-b.conf": `{}`}, noPrim: true, wantErr: "no primary"},
		{name: "named file malformed", file: "10-a.conflist", files: map[string]string{"10-a.conflist": `{"name":"a","plugins":[{"type":`, "20-b.conflist": `{"name":"b","plugins":[{"type":"ptp"}]}`}, wantErr: "10-a.conflist is invalid"},
		{name: "named file absent", file: "30-c.conflist", files: map[string]string{"20-b.conflist": `{"name":"b","plugins":[{"type":"ptp"}]}`}, noPrim: true, wantErr: "no primary"},
		{name: "invalid entry", entry: &bad, files: map[string]string{"20-b.conflist": `{"name":"b","plugins":[{"type":"ptp"}]}`}, wantErr: "backend \"ebpf\""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := tc.dir
			if dir == "" {
				dir = t.TempDir()
			}
			for n, c := range tc.files {
				if err := os.WriteFile(filepath.Join(dir, n), []byte(c), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			o := ConflistOptions{Dir: dir, FileName: tc.file, Chained: true, Entry: testEntry}
			if tc.entry != nil {
				o.Entry = *tc.entry
			}
			var before map[string]string
			if tc.dir == "" {
				before = readDir(t, dir)
			}
			_, err := InstallConflist(o)
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("Install error = %v, want one containing %q", err, tc.wantErr)
			}
			if errors.Is(err, ErrNoPrimary) != tc.noPrim {
				t.Errorf("errors.Is(err, ErrNoPrimary) = %v, want %v", !tc.noPrim, tc.noPrim)
			}
			if tc.dir == "" {
				after := readDir(t, dir)
				if len(after) != len(before) {
					t.Errorf("files changed: %v → %v", before, after)
				}
				for n, c := range before {
					if after[n] != c {
						t.Errorf("%s was overwritten", n)
					}
				}
			}
			if _, err := CheckConflist(o); err == nil {
				t.Error("Check: nil error, want one")
			}
		})
	}
}

// A primary rewritten between read and write is not overwritten with stale content.
func TestWriteIfUnchangedDetectsRewrite(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "10-a.conflist")
	orig := []byte(`{"name":"a","plugins":[{"type":"bridge"}]}`)
	if err := os.WriteFile(path, orig, 0o644); err != nil {
		t.Fatal(err)
	}
	p, _, err := FindPrimary(dir, "")
	if err != nil {
		t.Fatal(err)
	}
	newer := []byte(`{"name":"a","plugins":[{"type":"bridge","mtu":1400}]}`)
	if err := os.WriteFile(path+".new", newer, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(path+".new", path); err != nil {
		t.Fatal(err)
	}
	err = writeIfUnchanged(path, []byte(`{"stale":true}`), p)
	if !errors.Is(err, ErrChanged) {
		t.Fatalf("err = %v, want ErrChanged", err)
	}
	got, _ := os.ReadFile(path)
	if !bytes.Equal(got, newer) {
		t.Errorf("content = %s, want the newer write kept", got)
	}
}
