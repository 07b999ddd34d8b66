package istio_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/meshcni/meshcni/internal/env/istio"
	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/testkit/reporoot"
)

// TestCompatibilityTable: docs/istio.md's compatibility table has a row naming the
// Istio version pinned in hack/istio-build/go.mod and the test bed's Kubernetes
// version, the pair internal/env/istio/e2e proves.
func TestCompatibilityTable(t *testing.T) {
	root, err := reporoot.Find()
	if err != nil {
		t.Fatal(err)
	}
	version, err := istio.PinnedVersion(root)
	if err != nil {
		t.Fatal(err)
	}
	doc, err := os.ReadFile(filepath.Join(root, "docs", "istio.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, table, ok := strings.Cut(string(doc), "\n## Compatibility\n")
	if !ok {
		t.Fatal("docs/istio.md has no Compatibility section")
	}
	for _, line := range strings.Split(table, "\n") {
		if strings.HasPrefix(line, "| `"+istio.Module+" "+version+"`") && strings.Contains(line, "| "+testbed.KubernetesVersion+" ") {
			return
		}
	}
	t.Errorf("docs/istio.md's compatibility table has no row for %s %s on Kubernetes %s", istio.Module, version, testbed.KubernetesVersion)
}

func TestValuesAreCNIMode(t *testing.T) {
	v := istio.Values()
	pilot, _ := v["pilot"].(map[string]any)
	cni, _ := pilot["cni"].(map[string]any)
	if cni["enabled"] != true {
		t.Errorf("pilot.cni.enabled = %v, want true (the injector's CNI mode)", cni["enabled"])
	}
	global, _ := v["global"].(map[string]any)
	if global["hub"] != istio.Hub || global["tag"] != istio.Tag || global["imagePullPolicy"] != "Never" {
		t.Errorf("global %v: want the local proxy image, never pulled", global)
	}
}

func TestPinnedVersion(t *testing.T) {
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, istio.WrapperDir), 0o755); err != nil {
		t.Fatal(err)
	}
	gomod := filepath.Join(dir, istio.WrapperDir, "go.mod")
	for content, want := range map[string]string{
		"module x\n\nrequire istio.io/istio v0.0.0-20260827124520-eed52ebb66ad\n":     "v0.0.0-20260827124520-eed52ebb66ad",
		"module x\n\nrequire (\n\tistio.io/istio v1.28.0\n\tistio.io/api v1.0.0\n)\n": "v1.28.0",
		"module x\n\nrequire istio.io/istiox v1.0.0\n":                                "",
	} {
		if err := os.WriteFile(gomod, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		got, err := istio.PinnedVersion(dir)
		if got != want || (want == "") != (err != nil) {
			t.Errorf("%q: got %q, %v; want %q", content, got, err, want)
		}
	}
}

// TestDocNamesEveryE2ETest: docs/istio.md's "What the tests prove" names every test of
// internal/env/istio/e2e and internal/env/istio/migration, so a proof added there is described (and a removed one is not
// left claimed in the compatibility table's summary).
func TestDocNamesEveryE2ETest(t *testing.T) {
	root, err := reporoot.Find()
	if err != nil {
		t.Fatal(err)
	}
	doc, err := os.ReadFile(filepath.Join(root, "docs", "istio.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(doc), "\n## What the tests prove\n")
	section, _, _ = strings.Cut(section, "\n## ")
	if !ok {
		t.Fatal(`docs/istio.md has no "What the tests prove" section`)
	}
	var files []string
	for _, pkg := range []string{"e2e", "migration"} {
		fs, err := filepath.Glob(filepath.Join(root, "internal", "env", "istio", pkg, "*_test.go"))
		if err != nil || len(fs) == 0 {
			t.Fatalf("no test files in internal/env/istio/%s: %v", pkg, err)
		}
		files = append(files, fs...)
	}
	tests := 0
	for _, f := range files {
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(string(src), "\n") {
			name, ok := strings.CutPrefix(line, "func Test")
			if !ok || strings.HasPrefix(name, "Main(") {
				continue
			}
			name, _, _ = strings.Cut(name, "(")
			tests++
			if !strings.Contains(section, "`Test"+name+"`") {
				t.Errorf("docs/istio.md's \"What the tests prove\" does not name `Test%s` (%s)", name, filepath.Base(f))
			}
		}
	}
	if tests == 0 {
		t.Error("found no test in internal/env/istio/e2e")
	}
}
