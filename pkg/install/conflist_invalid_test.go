package install

import (
	"errors"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/meshcni/meshcni/pkg/cniconf"
)

// Configuration files of the invalid-file tests: what a half-written rewrite leaves.
const (
	calicoWithEntry = `{"cniVersion":"1.0.0","name":"k8s-pod-network","plugins":[{"type":"calico"},{"type":"istio-cni"},{"type":"meshcni","backend":"auto"}]}`
	calicoPlain     = `{"cniVersion":"1.0.0","name":"k8s-pod-network","plugins":[{"type":"calico"},{"type":"portmap"}]}`
	bridgeList      = `{"cniVersion":"1.0.0","name":"bridge","plugins":[{"type":"bridge"}]}`
	staleList       = `{"cniVersion":"1.0.0","name":"old","plugins":[{"type":"ptp"},{"type":"meshcni"}]}`
	loopbackConf    = `{"cniVersion":"1.0.0","name":"lo","type":"loopback"}`
)

// truncated is the first half of s: JSON cut off mid-write.
func truncated(s string) string { return s[:len(s)/2] }

// pluginTypes lists the plugin types of a configuration list ("" when it does not parse).
func pluginTypes(t *testing.T, data string) string {
	t.Helper()
	if ValidList([]byte(data)) != nil {
		return ""
	}
	var types []string
	for _, want := range []string{"calico", "istio-cni", "portmap", "bridge", "ptp", "meshcni"} {
		if strings.Contains(data, `"`+want+`"`) {
			types = append(types, want)
		}
	}
	return strings.Join(types, ",")
}

// TestInstallInvalidFile: a configuration file the runtime reads before the primary
// (truncated, empty, half-written) is never written or removed. When no file name is
// pinned, meshcni's entry is put into the next valid list — the one CRI-O uses in the
// meantime (containerd starts no pod while the broken file sorts first) — and nothing
// else is cleaned or converted until the broken file is valid again. A pinned file
// that is invalid is an ErrInvalid and nothing is written at all.
func TestInstallInvalidFile(t *testing.T) {
	for _, tc := range []struct {
		name  string
		pin   string
		files map[string]string
		// want: file → plugin types after Install ("" : content unchanged, byte for byte).
		want      map[string]string
		path      string   // Result.Path
		skipped   []string // Result.Skipped, base names
		noPrimary bool
		invalid   bool // errors.Is(err, ErrInvalid)
	}{
		{
			name:      "truncated primary alone",
			files:     map[string]string{"10-calico.conflist": truncated(calicoWithEntry)},
			want:      map[string]string{"10-calico.conflist": ""},
			skipped:   []string{"10-calico.conflist"},
			noPrimary: true,
		},
		{
			name: "truncated primary, next list gets the entry, stale entry kept",
			files: map[string]string{
				"10-calico.conflist": truncated(calicoWithEntry),
				"20-bridge.conflist": bridgeList,
				"30-old.conflist":    staleList,
			},
			want: map[string]string{
				"10-calico.conflist": "",
				"20-bridge.conflist": "bridge,meshcni",
				"30-old.conflist":    "",
			},
			path:    "20-bridge.conflist",
			skipped: []string{"10-calico.conflist"},
		},
		{
			name: "truncated primary, next is a single conf: converted, as the runtime would use it",
			files: map[string]string{
				"10-calico.conflist": truncated(calicoWithEntry),
				"99-loopback.conf":   loopbackConf,
			},
			want: map[string]string{
				"10-calico.conflist":   "",
				"99-loopback.conflist": "meshcni",
			},
			path:    "99-loopback.conflist",
			skipped: []string{"10-calico.conflist"},
		},
		{
			name: "truncated non-primary",
			files: map[string]string{
				"10-calico.conflist": calicoPlain,
				"20-half.conflist":   truncated(staleList),
			},
			want: map[string]string{
				"10-calico.conflist": "calico,portmap,meshcni",
				"20-half.conflist":   "",
			},
			path: "10-calico.conflist",
		},
		{
			name: "empty file first",
			files: map[string]string{
				"05-empty.conflist":  "",
				"10-calico.conflist": calicoPlain,
			},
			want: map[string]string{
				"05-empty.conflist":  "",
				"10-calico.conflist": "calico,portmap,meshcni",
			},
			path:    "10-calico.conflist",
			skipped: []string{"05-empty.conflist"},
		},
		{
			name: "pinned primary truncated",
			pin:  "10-calico.conflist",
			files: map[string]string{
				"10-calico.conflist": truncated(calicoWithEntry),
				"20-bridge.conflist": bridgeList,
			},
			want:    map[string]string{"10-calico.conflist": "", "20-bridge.conflist": ""},
			skipped: []string{"10-calico.conflist"},
			invalid: true,
		},
		{
			name: "pinned primary empty",
			pin:  "10-calico.conflist",
			files: map[string]string{
				"10-calico.conflist": "",
			},
			want:    map[string]string{"10-calico.conflist": ""},
			skipped: []string{"10-calico.conflist"},
			invalid: true,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			for n, c := range tc.files {
				if err := os.WriteFile(filepath.Join(dir, n), []byte(c), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			res, err := InstallConflist(ConflistOptions{Dir: dir, FileName: tc.pin, Chained: true, Entry: testEntry})
			switch {
			case tc.noPrimary:
				if !errors.Is(err, ErrNoPrimary) {
					t.Errorf("Install error = %v, want ErrNoPrimary", err)
				}
			case tc.invalid:
				if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.pin) {
					t.Errorf("Install error = %v, want ErrInvalid naming %s", err, tc.pin)
				}
			case err != nil:
				t.Fatalf("Install: %v", err)
			}
			if tc.path != "" && filepath.Base(res.Path) != tc.path {
				t.Errorf("Result.Path = %s, want %s", res.Path, tc.path)
			}
			var skipped []string
			for _, s := range res.Skipped {
				skipped = append(skipped, filepath.Base(s.Path))
				if s.Err == nil {
					t.Errorf("%s skipped without a reason", s.Path)
				}
			}
			if !slices.Equal(skipped, tc.skipped) {
				t.Errorf("Result.Skipped = %v, want %v", skipped, tc.skipped)
			}
			got := readDir(t, dir)
			if !slices.Equal(slices.Sorted(maps.Keys(got)), slices.Sorted(maps.Keys(tc.want))) {
				t.Fatalf("files %v, want %v", slices.Sorted(maps.Keys(got)), slices.Sorted(maps.Keys(tc.want)))
			}
			for n, w := range tc.want {
				if w == "" {
					if got[n] != tc.files[n] {
						t.Errorf("%s changed:\n%s\nwant it untouched:\n%s", n, got[n], tc.files[n])
					}
					continue
				}
				if pt := pluginTypes(t, got[n]); pt != w {
					t.Errorf("%s holds %q, want %q:\n%s", n, pt, w, got[n])
				}
			}
		})
	}
}

// TestInstallWhileRewritten: the primary is rewritten non-atomically (istio-cni's
// uninstaller removing its entry): read empty, then half-written, then complete
// without meshcni's entry. Meanwhile the next valid list carries the entry; once the
// primary is whole again the entry goes back into it and leaves the other list as it
// was. The primary's bytes are never written while they are invalid.
func TestInstallWhileRewritten(t *testing.T) {
	dir := t.TempDir()
	primary, other := filepath.Join(dir, "10-calico.conflist"), filepath.Join(dir, "20-bridge.conflist")
	write := func(path, data string) {
		t.Helper()
		// os.WriteFile truncates in place: what a non-atomic writer does.
		if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	read := func(path string) string {
		t.Helper()
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	o := ConflistOptions{Dir: dir, Chained: true, Entry: testEntry}
	write(primary, calicoPlain)
	write(other, bridgeList)
	if res, err := InstallConflist(o); err != nil || filepath.Base(res.Path) != "10-calico.conflist" {
		t.Fatalf("first Install = %+v, %v", res, err)
	}
	whole := strings.TrimSpace(read(primary))
	for _, state := range []string{"", truncated(whole), whole[:len(whole)-1]} {
		write(primary, state)
		res, err := InstallConflist(o)
		if err != nil {
			t.Fatalf("Install with the primary %q: %v", state, err)
		}
		if len(res.Skipped) != 1 || res.Skipped[0].Path != primary {
			t.Errorf("Skipped = %v, want the primary", res.Skipped)
		}
		if got := read(primary); got != state {
			t.Fatalf("the invalid primary was written: %q, want %q", got, state)
		}
		if pt := pluginTypes(t, read(other)); pt != "bridge,meshcni" {
			t.Errorf("while the primary is invalid, %s holds %q, want bridge,meshcni", other, pt)
		}
		if path, err := CheckConflist(o); err != nil || path != other {
			t.Errorf("Check = %s, %v; want %s, nil", path, err, other)
		}
	}
	// Complete again, without our entry (the uninstaller rewrote it from its copy).
	write(primary, calicoPlain)
	res, err := InstallConflist(o)
	if err != nil || res.Path != primary || !res.Missing || len(res.Skipped) != 0 {
		t.Fatalf("Install after the rewrite = %+v, %v; want the entry put back into the primary", res, err)
	}
	if !slices.Equal(res.Cleaned, []string{other}) {
		t.Errorf("Cleaned = %v, want [%s]", res.Cleaned, other)
	}
	if pt := pluginTypes(t, read(primary)); pt != "calico,portmap,meshcni" {
		t.Errorf("primary holds %q", pt)
	}
	if pt := pluginTypes(t, read(other)); pt != "bridge" {
		t.Errorf("%s holds %q after recovery, want bridge", other, pt)
	}
}

// TestUninstallInvalidList: Uninstall cannot tell whether an unparseable list holds
// meshcni's entry; it leaves the file alone, cleans the others and says which file it
// could not check (ErrInvalid), so the caller keeps the plugin binary the entry needs.
func TestUninstallInvalidList(t *testing.T) {
	dir := t.TempDir()
	files := map[string]string{
		"05-empty.conflist":     "",
		"10-calico.conflist":    truncated(calicoWithEntry),
		"20-old.conflist":       staleList,
		"30-noplugins.conflist": `{"cniVersion":"1.0.0","name":"e","plugins":[]}`,
		"40-bad.conf":           truncated(loopbackConf),
	}
	for n, c := range files {
		if err := os.WriteFile(filepath.Join(dir, n), []byte(c), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	changed, err := UninstallConflist(ConflistOptions{Dir: dir, Chained: true, Entry: testEntry})
	if !errors.Is(err, ErrInvalid) {
		t.Fatalf("Uninstall error = %v, want ErrInvalid", err)
	}
	for _, n := range []string{"05-empty.conflist", "10-calico.conflist"} {
		if !strings.Contains(err.Error(), n) {
			t.Errorf("Uninstall error %q does not name %s", err, n)
		}
	}
	for _, n := range []string{"20-old.conflist", "30-noplugins.conflist", "40-bad.conf"} {
		if strings.Contains(err.Error(), n) {
			t.Errorf("Uninstall error %q names %s, which cannot hold an unseen entry", err, n)
		}
	}
	if !slices.Equal(changed, []string{filepath.Join(dir, "20-old.conflist")}) {
		t.Errorf("changed = %v, want the stale list only", changed)
	}
	got := readDir(t, dir)
	for _, n := range []string{"05-empty.conflist", "10-calico.conflist", "30-noplugins.conflist", "40-bad.conf"} {
		if got[n] != files[n] {
			t.Errorf("%s changed: %q", n, got[n])
		}
	}
	if _, _, err := cniconf.Remove([]byte(got["20-old.conflist"])); err != nil || strings.Contains(got["20-old.conflist"], "meshcni") {
		t.Errorf("20-old.conflist still holds meshcni: %s", got["20-old.conflist"])
	}
}
