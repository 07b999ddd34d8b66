// Package layout holds the test that keeps the house in order: what may import
// what (docs/developing.md draws it).
package layout

import (
	"encoding/json"
	"io"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
)

const module = "github.com/meshcni/meshcni"

// productInternal are the internal/ packages that are part of the product (code a
// node runs), not test, build or demo tools: product packages may import these.
var productInternal = []string{
	module + "/internal/nl",
}

// pure are the packages that turn configuration into rules: no effects (no exec, no
// netlink, no files, no network, no Kubernetes), so they can be read and tested alone.
var pure = []string{
	module + "/pkg/spec",
	module + "/pkg/rules",
	module + "/pkg/rules/ipt",
	module + "/pkg/rules/nft",
	module + "/pkg/capture",
}

// effects are imports a pure package must not have: standard packages by exact
// path (net/netip is pure, net is not), modules and our effect packages by prefix.
var effects = []string{
	"=os", "=os/exec", "=syscall", "=net", "=net/http", "=io/fs",
	"golang.org/x/sys/", "github.com/vishvananda/", "github.com/google/nftables",
	"github.com/mdlayher/", "github.com/containernetworking/", "k8s.io/",
	module + "/pkg/engine", module + "/pkg/backend", module + "/pkg/netnsutil", module + "/internal/",
}

type pkg struct {
	ImportPath string
	Imports    []string // non-test imports
	Deps       []string
}

func list(t *testing.T, patterns ...string) []pkg {
	t.Helper()
	gobin := testutil.RequireBinary(t, "go")
	root, err := testutil.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(gobin, append([]string{"list", "-json=ImportPath,Imports,Deps"}, patterns...)...)
	cmd.Dir = root
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	var pkgs []pkg
	dec := json.NewDecoder(strings.NewReader(string(out)))
	for {
		var p pkg
		if err := dec.Decode(&p); err == io.EOF {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		pkgs = append(pkgs, p)
	}
	if len(pkgs) == 0 {
		t.Fatalf("go list %v: no packages", patterns)
	}
	return pkgs
}

func matches(imp, prefix string) bool {
	if exact, ok := strings.CutPrefix(prefix, "="); ok {
		return imp == exact
	}
	if strings.HasSuffix(prefix, "/") {
		return strings.HasPrefix(imp, prefix)
	}
	return imp == prefix || strings.HasPrefix(imp, prefix+"/")
}

// TestProductImportsNoTools: nothing a node runs (pkg/*, cmd/*) depends, even
// indirectly, on a test, build or demo tool under internal/ or on hack/.
func TestProductImportsNoTools(t *testing.T) {
	for _, p := range list(t, "./pkg/...", "./cmd/...") {
		for _, d := range p.Deps {
			if (matches(d, module+"/internal") && !slices.Contains(productInternal, d)) || matches(d, module+"/hack") {
				t.Errorf("%s depends on %s: product code must not import test, build or demo tools", p.ImportPath, d)
			}
		}
	}
}

// TestPureCoreHasNoEffects: config → rules stays pure.
func TestPureCoreHasNoEffects(t *testing.T) {
	for _, p := range list(t, pure...) {
		for _, imp := range p.Imports {
			for _, e := range effects {
				if matches(imp, e) {
					t.Errorf("%s imports %s: the pure core (spec, model, renderers, pod decision) does no I/O", p.ImportPath, imp)
				}
			}
		}
	}
}

// TestNoImportOfCommands: cmd/* and hack/* are fronts; nothing imports them.
func TestNoImportOfCommands(t *testing.T) {
	for _, p := range list(t, "./...") {
		for _, imp := range p.Imports {
			if matches(imp, module+"/cmd") || matches(imp, module+"/hack") {
				t.Errorf("%s imports %s: commands are thin fronts, move shared code into a package", p.ImportPath, imp)
			}
		}
	}
}

// linkRules are prefixes a command must not link, each with why (the plugin's own,
// stricter rule is pkg/plugin's TestPluginLinksNoKubernetes).
var linkRules = []struct {
	cmd       string
	forbidden []string
	why       string
}{
	{"./cmd/meshcnictl", []string{"github.com/prometheus/"}, "meshcnictl serves no metrics: the meshcni_build_info gauge lives in pkg/buildinfo/buildmetrics, buildinfo.Info does not need the Prometheus client"},
}

// TestCommandLinkRules: each command links none of its forbidden packages, even
// indirectly.
func TestCommandLinkRules(t *testing.T) {
	for _, r := range linkRules {
		p := list(t, r.cmd)[0]
		if len(p.Deps) < 20 {
			t.Fatalf("go list %s: %d dependencies, not the command's graph", r.cmd, len(p.Deps))
		}
		for _, d := range p.Deps {
			for _, f := range r.forbidden {
				if matches(d, f) {
					t.Errorf("%s links %s (forbidden %q): %s; `go list -deps %s` shows the path", r.cmd, d, f, r.why, r.cmd)
				}
			}
		}
	}
}

// TestMatches pins the prefix rule the checks above rely on.
func TestMatches(t *testing.T) {
	for _, tc := range []struct {
		imp, prefix string
		want        bool
	}{
		{"os", "os", true},
		{"os/exec", "os", true},
		{"osx", "os", false},
		{"net", "=net", true},
		{"net/netip", "=net", false},
		{"golang.org/x/sys/unix", "golang.org/x/sys/", true},
		{"github.com/meshcni/meshcni/internal/env/testbed", module + "/internal", true},
		{"github.com/meshcni/meshcni/internalx", module + "/internal", false},
	} {
		if got := matches(tc.imp, tc.prefix); got != tc.want {
			t.Errorf("matches(%q, %q) = %v, want %v", tc.imp, tc.prefix, got, tc.want)
		}
	}
}
