package istio_test

import (
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/meshcni/meshcni/internal/env/istio"
	"github.com/meshcni/meshcni/internal/testkit/reporoot"
)

func TestDocBlock(t *testing.T) {
	for _, tc := range []struct {
		name, doc, err string
		want           [][]string
	}{
		{
			name: "commands, comments, continuation",
			doc:  "text\n```sh a\n# c\nhelm upgrade x \\\n  --set y=z\n\nkubectl get pods\n```\n```sh b\nhelm no\n```\n",
			want: [][]string{{"helm", "upgrade", "x", "--set", "y=z"}, {"kubectl", "get", "pods"}},
		},
		{name: "no block", doc: "```sh b\nhelm x\n```\n", err: `no block tagged "a"`},
		{name: "two blocks", doc: "```sh a\nhelm x\n```\n```sh a\nhelm y\n```\n", err: `line 4: a second block tagged "a"`},
		{name: "unclosed", doc: "```sh a\nhelm x\n", err: "not closed"},
		{name: "empty", doc: "```sh a\n# only\n```\n", err: "holds no command"},
		{name: "shell syntax", doc: "```sh a\nhelm x | tee y\n```\n", err: `line 2: "helm x | tee y": '|' is shell syntax`},
		{name: "variable", doc: "```sh a\nhelm x $V\n```\n", err: `'$' is shell syntax`},
		{name: "other tag only", doc: "```sh ab\nhelm x\n```\n", err: `no block tagged "a"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := istio.DocBlock([]byte(tc.doc), "a")
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil || !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("got %q, %v; want %q", got, err, tc.want)
			}
		})
	}
}

func TestSubstitute(t *testing.T) {
	argv := []string{"helm", "install", "x", "istio/cni", "-f", "v.yaml", "--set", "istio/cni"}
	got := istio.Substitute(argv, map[string]string{"istio/cni": "/c", "v.yaml": "/v"})
	want := []string{"helm", "install", "x", "/c", "-f", "/v", "--set", "/c"}
	if !reflect.DeepEqual(got, want) || argv[3] != "istio/cni" {
		t.Errorf("got %q (argv %q), want %q and argv unchanged", got, argv, want)
	}
}

// TestMigrationDocBlocks: docs/migration.md's two Helm procedures parse, run only
// helm and kubectl, keep istiod's injector in CNI mode with pilot.cni.enabled (never
// the removed istio_cni.enabled), and add the new CNI before removing the old one;
// its istioctl procedure parses and installs with the overlay TestIstioctlOverlay
// renders.
func TestMigrationDocBlocks(t *testing.T) {
	root, err := reporoot.Find()
	if err != nil {
		t.Fatal(err)
	}
	doc, err := os.ReadFile(filepath.Join(root, "docs", "migration.md"))
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(doc), "istio_cni.enabled=true") {
		t.Error("docs/migration.md sets istio_cni.enabled, which Istio removed in 1.24")
	}
	cmds, err := istio.DocBlock(doc, "istioctl-to-meshcni")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(cmds, func(c []string) bool {
		return c[0] == "istioctl" && c[1] == "install" && slices.Contains(c, "istioctl-overlay.yaml")
	}) {
		t.Errorf("istioctl-to-meshcni: %q: no istioctl install with istioctl-overlay.yaml (the doc's overlay block)", cmds)
	}
	for tag, order := range map[string][2]string{
		"istio-cni-to-meshcni": {"install meshcni", "uninstall istio-cni"},
		"meshcni-to-istio-cni": {"install istio-cni", "uninstall meshcni"},
	} {
		cmds, err := istio.DocBlock(doc, tag)
		if err != nil {
			t.Fatal(err)
		}
		var lines []string
		for _, c := range cmds {
			if c[0] != "helm" && c[0] != "kubectl" {
				t.Errorf("%s: %q: only helm and kubectl", tag, c)
			}
			lines = append(lines, strings.Join(c, " "))
		}
		if !slices.ContainsFunc(lines, func(l string) bool {
			return strings.HasPrefix(l, "helm upgrade istiod ") && strings.Contains(l, "--set pilot.cni.enabled=true")
		}) {
			t.Errorf("%s: no helm upgrade of istiod with pilot.cni.enabled=true", tag)
		}
		install := slices.IndexFunc(lines, func(l string) bool {
			return strings.HasPrefix(l, "helm upgrade --install "+strings.TrimPrefix(order[0], "install ")+" ")
		})
		remove := slices.IndexFunc(lines, func(l string) bool {
			return strings.HasPrefix(l, "helm uninstall "+strings.TrimPrefix(order[1], "uninstall ")+" ")
		})
		if install < 0 || remove < 0 || install > remove {
			t.Errorf("%s: %s at line %d, %s at line %d: want both, the install first", tag, order[0], install, order[1], remove)
		}
	}
}
