package deploy_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"

	"github.com/meshcni/meshcni/internal/env/istio"
	"github.com/meshcni/meshcni/internal/testkit/golden"
	"github.com/meshcni/meshcni/internal/testkit/reporoot"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
)

// compatPath is the chart's table of Istio's istio-cni values (docs/reference.md shows it).
const compatPath = chartDir + "/files/istio-cni.yaml"

// Testdata: Istio's chart defaults (regenerated from the module cache with -update, so a
// change of Istio's defaults fails TestIstioDefaultsCurrent) and a production override.
const (
	istioDefaultsFile   = "testdata/istio-cni-defaults.yaml"
	istioProductionFile = "testdata/istio-cni-production.yaml"
)

type compatEntry struct {
	Istio    string `yaml:"istio"`
	Meshcni  string `yaml:"meshcni"`
	Accept   []any  `yaml:"accept"`
	Refuse   string `yaml:"refuse"`
	NoEffect string `yaml:"noEffect"`
	Legacy   bool   `yaml:"legacy"`
}

func compatTable(t testing.TB) []compatEntry {
	t.Helper()
	b, err := os.ReadFile(compatPath)
	if err != nil {
		t.Fatal(err)
	}
	var f struct{ Values []compatEntry }
	if err := yaml.Unmarshal(b, &f); err != nil {
		t.Fatalf("%s: %v", compatPath, err)
	}
	return f.Values
}

// istioCNIChart is Istio's istio-cni chart in the Go module cache, at the version
// hack/istio-build pins (the Istio the test bed runs).
func istioCNIChart(t testing.TB) string {
	t.Helper()
	root, err := reporoot.Find()
	if err != nil {
		t.Fatal(err)
	}
	version, err := istio.PinnedVersion(root)
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("go", "env", "GOMODCACHE").Output()
	if err != nil {
		t.Fatalf("go env GOMODCACHE: %v", err)
	}
	dir := filepath.Join(strings.TrimSpace(string(out)), istio.Module+"@"+version, "manifests", "charts", "istio-cni")
	if _, err := os.Stat(filepath.Join(dir, "values.yaml")); err != nil {
		testutil.Missing(t, "Istio's istio-cni chart is not in the module cache (%v): run hack/istio build", err)
	}
	return dir
}

// istioDefaults returns what Istio's values.yaml holds under _internal_defaults_do_not_set:
// the chart's defaults, as a user sets them (at the top level).
func istioDefaults(t testing.TB) map[string]any {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(istioCNIChart(t), "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var v struct {
		Defaults map[string]any `yaml:"_internal_defaults_do_not_set"`
	}
	if err := yaml.Unmarshal(b, &v); err != nil || len(v.Defaults) == 0 {
		t.Fatalf("Istio's values.yaml: %v (%d defaults)", err, len(v.Defaults))
	}
	return v.Defaults
}

// istioLeaves lists the keys of Istio's defaults down to the table's entries: a map is
// entered unless the table has an entry for it (affinity, resources, ...).
func istioLeaves(m map[string]any, prefix string, entries map[string]bool, out map[string]any) {
	for k, v := range m {
		p := k
		if prefix != "" {
			p = prefix + "." + k
		}
		if sub, ok := v.(map[string]any); ok && len(sub) > 0 && !entries[p] {
			istioLeaves(sub, p, entries, out)
			continue
		}
		out[p] = v
	}
}

// templateValueRefs finds the values Istio's templates read: .Values.a.b, ($.Values).a,
// ($.Values.global).a, (index $.Values "cni").
func templateValueRefs(t testing.TB) map[string]bool {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(istioCNIChart(t), "templates", "*"))
	if err != nil || len(files) < 5 {
		t.Fatalf("Istio's templates: %v (%d files)", err, len(files))
	}
	ref := regexp.MustCompile(`\$?\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)*)\)?((?:\.[A-Za-z_][A-Za-z0-9_]*)*)`)
	index := regexp.MustCompile(`index \$?\.Values "([A-Za-z_][A-Za-z0-9_]*)"`)
	refs := map[string]bool{}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range ref.FindAllStringSubmatch(string(b), -1) {
			if p := strings.TrimPrefix(m[1]+m[2], "."); p != "" {
				refs[p] = true
			}
		}
		for _, m := range index.FindAllStringSubmatch(string(b), -1) {
			refs[m[1]] = true
		}
	}
	return refs
}

// TestIstioValuesEnumerated: every value of Istio's istio-cni chart — each key of its
// values.yaml and each value its templates read — is in the chart's table, mapped,
// refused or accepted with no effect; a refused value accepts Istio's default; the table
// names nothing Istio does not have (but the older keys it marks legacy).
func TestIstioValuesEnumerated(t *testing.T) {
	table := compatTable(t)
	entries := map[string]bool{}
	for _, e := range table {
		if entries[e.Istio] {
			t.Errorf("%s: twice in the table", e.Istio)
		}
		entries[e.Istio] = true
		n := 0
		for _, s := range []string{e.Meshcni, e.Refuse, e.NoEffect} {
			if s != "" {
				n++
			}
		}
		if n != 1 {
			t.Errorf("%s: want exactly one of meshcni, refuse, noEffect", e.Istio)
		}
		if e.Accept != nil && e.Refuse == "" {
			t.Errorf("%s: accept without refuse", e.Istio)
		}
	}
	covered := func(p string) bool {
		for q := p; q != ""; {
			if entries[q] {
				return true
			}
			i := strings.LastIndex(q, ".")
			if i < 0 {
				break
			}
			q = q[:i]
		}
		return false
	}
	leaves := map[string]any{}
	istioLeaves(istioDefaults(t), "", entries, leaves)
	refs := templateValueRefs(t)
	known := map[string]bool{}
	for p := range leaves {
		known[p] = true
		if !covered(p) {
			t.Errorf("Istio value %s (values.yaml) is not in %s: map it, refuse it or say why it has no effect", p, compatPath)
		}
	}
	for p := range refs {
		known[p] = true
		if !covered(p) && !slices.ContainsFunc(table, func(e compatEntry) bool { return strings.HasPrefix(e.Istio, p+".") }) {
			t.Errorf("Istio value %s (read by its templates) is not in %s", p, compatPath)
		}
	}
	for _, e := range table {
		if !e.Legacy && !known[e.Istio] && !slices.ContainsFunc(sortedKeys(known), func(k string) bool { return strings.HasPrefix(k, e.Istio+".") }) {
			t.Errorf("%s: Istio's chart has no such value (mark it legacy if an older Istio had it)", e.Istio)
		}
		if def, ok := leaves[e.Istio]; ok && e.Refuse != "" && !slices.ContainsFunc(e.Accept, func(a any) bool { return jsonEqual(a, def) }) {
			t.Errorf("%s: Istio's default %v is refused", e.Istio, def)
		}
	}
	// Accepted with no effect: a short list, each one justified in the table.
	var none []string
	for _, e := range table {
		if e.NoEffect != "" {
			none = append(none, e.Istio)
		}
	}
	if want := []string{"global.logAsJson", "repair.hub", "repair.tag", "ownerName"}; !slices.Equal(none, want) {
		t.Errorf("accepted with no effect: %v, want %v", none, want)
	}
	t.Logf("%d Istio values: %d mapped, %d refused unless harmless, %d without effect",
		len(table), count(table, func(e compatEntry) bool { return e.Meshcni != "" }), count(table, func(e compatEntry) bool { return e.Refuse != "" }), len(none))
}

func count(es []compatEntry, f func(compatEntry) bool) int {
	n := 0
	for _, e := range es {
		if f(e) {
			n++
		}
	}
	return n
}

func sortedKeys(m map[string]bool) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}

func jsonEqual(a, b any) bool {
	x, err1 := json.Marshal(a)
	y, err2 := json.Marshal(b)
	return err1 == nil && err2 == nil && string(x) == string(y)
}

// TestIstioDefaultsCurrent: testdata/istio-cni-defaults.yaml is Istio's chart's defaults
// at the pinned version (-update rewrites it).
func TestIstioDefaultsCurrent(t *testing.T) {
	var buf bytes.Buffer
	enc := yaml.NewEncoder(&buf)
	enc.SetIndent(2)
	if err := enc.Encode(istioDefaults(t)); err != nil {
		t.Fatal(err)
	}
	b := buf.Bytes()
	head := "# Istio's istio-cni chart defaults (its values.yaml, _internal_defaults_do_not_set) at the\n" +
		"# version hack/istio-build pins, as a user's values file. Generated: go test ./deploy -run TestIstioDefaultsCurrent -update\n"
	golden.File(t, istioDefaultsFile, append([]byte(head), b...), "go test ./deploy -run TestIstioDefaultsCurrent -update")
}

// refusedValue is a value of a refused key that it does not accept.
func refusedValue(e compatEntry) any {
	switch {
	case len(e.Accept) == 0:
		return map[string]any{"x": "y"}
	case slices.ContainsFunc(e.Accept, func(a any) bool { return a == false }) && !slices.Contains(e.Accept, any(true)):
		return true
	case slices.Contains(e.Accept, any(true)) && !slices.Contains(e.Accept, any(false)):
		return false
	default:
		return "bogus"
	}
}

// TestIstioValuesRefused: each refused Istio value fails helm template (what helm install
// runs) with one line naming the value and what to use instead. (helm lint reports a
// template's fail as INFO only.)
func TestIstioValuesRefused(t *testing.T) {
	for _, e := range compatTable(t) {
		if e.Refuse == "" {
			continue
		}
		t.Run(e.Istio, func(t *testing.T) {
			bad := refusedValue(e)
			j, _ := json.Marshal(bad)
			want := fmt.Sprintf("Istio istio-cni value %s=%s has no meshcni equivalent: %s\n", e.Istio, j, e.Refuse)
			set := "json:" + e.Istio + "=" + string(j)
			_, err := runHelm(t, templateArgs(namespace, []string{set})...)
			if err == nil || !strings.Contains(err.Error(), "): "+want) {
				t.Fatalf("helm template --set-json %s=%s: %v\nwant the line %q", e.Istio, j, err, want)
			}
		})
	}
	// Written out once, independently of the table: the exact line.
	_, err := runHelm(t, templateArgs(namespace, []string{"ambient.enabled=true"})...)
	want := "Istio istio-cni value ambient.enabled=true has no meshcni equivalent: meshcni redirects sidecar pods only; ambient mode needs Istio's istio-cni and ztunnel"
	if err == nil || !regexp.MustCompile(`(?m)^Error: execution error at \([^)]*\): `+regexp.QuoteMeta(want)+`$`).MatchString(err.Error()) {
		t.Fatalf("ambient.enabled=true: %v\nwant the line %q", err, want)
	}
}

// TestChartRefusesCombinations: what the chart refuses beyond single Istio values.
func TestChartRefusesCombinations(t *testing.T) {
	for _, tc := range []struct {
		values []string
		want   string
	}{
		{[]string{"podLabels.k8s-app=istio-cni-node"}, "podLabels k8s-app=istio-cni-node hands the node taint to istiod's untaint controller (pilot.taint.enabled) while taintController.enabled runs meshcni's: run one, set taintController.enabled=false or remove the label (docs/taint.md)"},
		{[]string{"provider=multus"}, "provider multus needs chained=false: Multus runs meshcni as an additional network from its own list"},
		{[]string{"logging.level=cni:debug"}, `logging.level="cni:debug" names no default scope: meshcni has one log level; set logLevel (debug, info, warn or error)`},
		{[]string{"global.logging.level=none"}, `global.logging.level="none": meshcni's log levels are debug, info, warn and error; set logLevel`},
		{[]string{"podLabels.app\\.kubernetes\\.io/component=x"}, "invalid propertyName 'app.kubernetes.io/component'"},
		{[]string{"updateStrategy.type=Sometimes"}, "at '/updateStrategy/type'"},
		{[]string{"networkName=istio cni"}, "at '/networkName'"},
		{[]string{"provider=calico"}, "at '/provider'"},
		{[]string{"env.1BAD=x"}, "invalid propertyName '1BAD'"},
	} {
		t.Run(strings.Join(tc.values, ","), func(t *testing.T) {
			_, err := runHelm(t, templateArgs(namespace, tc.values)...)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("%v: %v\nwant %q", tc.values, err, tc.want)
			}
		})
	}
}
