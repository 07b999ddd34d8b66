// Package layout holds the test that keeps the house in order: what may import
// what (docs/developing.md draws it).
package layout

import (
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
)

const module = "github.com/meshcni/meshcni"

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
// indirectly, on a package under internal/ (test, build and demo tools only) or on
// hack/.
func TestProductImportsNoTools(t *testing.T) {
	for _, p := range list(t, "./pkg/...", "./cmd/...") {
		for _, d := range p.Deps {
			if matches(d, module+"/internal") || matches(d, module+"/hack") {
				t.Errorf("%s depends on %s: product code must not import internal/ (test, build or demo tools)", p.ImportPath, d)
			}
		}
	}
}

// netlinkClients are the netlink client libraries a Go program can link. A shipped
// command links pkg/netlink, meshcni's own, for every rtnetlink and nfnetlink read
// and rtnetlink write; mdlayher/netlink only as google/nftables' transport (the
// nftables backend's rule batches and rule reads), imported by nothing else.
var netlinkClients = []string{
	module + "/pkg/netlink",
	"github.com/mdlayher/netlink",
	"github.com/vishvananda/netlink",
	"github.com/jsimonetti/rtnetlink",
}

// nftablesTransport are the packages that may import mdlayher/netlink: google/nftables
// itself, mdlayher's own, and the nftables backend (google/nftables' socket options
// hand it a *netlink.Conn).
var nftablesTransport = []string{"github.com/google/nftables", "github.com/mdlayher/", module + "/pkg/backend/nftables"}

// TestCommandsLinkOneNetlinkStack: every shipped command (cmd/*) reads and writes
// netlink through pkg/netlink only; a general netlink library comes in only as
// google/nftables' own transport. Each command's netlink packages are logged.
func TestCommandsLinkOneNetlinkStack(t *testing.T) {
	cmds := list(t, "./cmd/...")
	var deps []string
	for _, c := range cmds {
		deps = append(deps, c.Deps...)
	}
	importers := map[string]pkg{}
	for _, p := range list(t, deps...) {
		importers[p.ImportPath] = p
	}
	for _, c := range cmds {
		var linked []string
		for _, d := range c.Deps {
			for _, l := range netlinkClients {
				if matches(d, l) {
					linked = append(linked, d)
				}
			}
			if matches(d, "github.com/vishvananda/netlink") || matches(d, "github.com/jsimonetti/rtnetlink") {
				t.Errorf("%s links %s: shipped commands use pkg/netlink for netlink", c.ImportPath, d)
			}
			for _, imp := range importers[d].Imports {
				if matches(imp, "github.com/mdlayher/netlink") && !slices.ContainsFunc(nftablesTransport, func(p string) bool { return matches(d, p) }) {
					t.Errorf("%s (linked by %s) imports %s: mdlayher/netlink is google/nftables' transport only; use pkg/netlink", d, c.ImportPath, imp)
				}
			}
		}
		t.Logf("%s links netlink packages %v", c.ImportPath, linked)
	}
}

// The plugin's footprint ceilings: today's figures (docs/performance.md, "The
// plugin binary"). The plugin runs once per pod sandbox for ADD and for DEL; a
// change that raises either one raises it here, on purpose, with its figure.
const (
	pluginMaxDeps  = 131       // go list -deps ./cmd/meshcni | wc -l
	pluginMaxBytes = 4_284_578 // CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' ./cmd/meshcni
)

// TestPluginFootprint: the plugin's package count and stripped binary size, logged,
// do not exceed their ceilings.
func TestPluginFootprint(t *testing.T) {
	p := list(t, "./cmd/meshcni")[0]
	deps := len(p.Deps) + 1 // go list -deps also lists the command itself
	var netlinkDeps int
	for _, d := range p.Deps {
		if strings.Contains(d, "netlink") {
			netlinkDeps++
		}
	}
	gobin := testutil.RequireBinary(t, "go")
	root, err := testutil.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(t.TempDir(), "meshcni")
	cmd := exec.Command(gobin, "build", "-trimpath", "-ldflags=-s -w", "-o", bin, "./cmd/meshcni")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/meshcni: %v\n%s", err, out)
	}
	st, err := os.Stat(bin)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("cmd/meshcni: %d packages (%d with netlink in their path), %d bytes stripped (ceilings %d, %d)", deps, netlinkDeps, st.Size(), pluginMaxDeps, pluginMaxBytes)
	if deps > pluginMaxDeps {
		t.Errorf("cmd/meshcni links %d packages, more than its ceiling %d: `go list -deps ./cmd/meshcni` shows them", deps, pluginMaxDeps)
	}
	if st.Size() > pluginMaxBytes {
		t.Errorf("cmd/meshcni is %d bytes stripped, more than its ceiling %d", st.Size(), pluginMaxBytes)
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
