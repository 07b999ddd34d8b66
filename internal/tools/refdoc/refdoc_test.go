package refdoc

import (
	"strings"
	"testing"

	"github.com/spf13/pflag"

	"github.com/meshcni/meshcni/internal/testkit/golden"
	"github.com/meshcni/meshcni/pkg/agent"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/flagenv"
	"github.com/meshcni/meshcni/pkg/taint"
)

const (
	referencePath = "../../../docs/reference.md"
	valuesPath    = "../../../deploy/charts/meshcni/values.yaml"
	istioPath     = "../../../deploy/charts/meshcni/files/istio-cni.yaml"
)

func input(t *testing.T) Input {
	t.Helper()
	values, err := ReadValues(valuesPath)
	if err != nil {
		t.Fatal(err)
	}
	istio, err := ReadValues(istioPath)
	if err != nil {
		t.Fatal(err)
	}
	return Input{
		Binaries: []Binary{
			{Name: "meshcni-agent", EnvPrefix: agent.EnvPrefix, Doc: "The node agent (DaemonSet): installs and guards the plugin, serves health and metrics, repairs pods.", Flags: agent.FlagSet()},
			{Name: "meshcni-taint-controller", EnvPrefix: taint.EnvPrefix, Doc: "The taint controller (Deployment, leader-elected): puts `cni.istio.io/not-ready:NoSchedule` on nodes whose agent is not Ready (joining nodes only by default; never more than `--max-tainted-fraction` of them).", Flags: taint.FlagSet()},
		},
		Values:          values,
		ValuesPath:      "deploy/charts/meshcni/values.yaml",
		IstioValues:     istio,
		IstioValuesPath: "deploy/charts/meshcni/files/istio-cni.yaml",
	}
}

// TestReferenceUpToDate fails when docs/reference.md is not what the code generates
// now; `go test ./internal/tools/refdoc -update` (make reference) rewrites it.
func TestReferenceUpToDate(t *testing.T) {
	got, err := Generate(input(t))
	if err != nil {
		t.Fatal(err)
	}
	golden.File(t, referencePath, got, "generate it: make reference")
}

// TestReferenceCoversEverything checks the generated text names every pod setting,
// plugin key and agent flag (so a section cannot silently go missing).
func TestReferenceCoversEverything(t *testing.T) {
	got, err := Generate(input(t))
	if err != nil {
		t.Fatal(err)
	}
	text := string(got)
	for _, s := range capture.Settings {
		if !strings.Contains(text, "`"+s.Key+"`") {
			t.Errorf("pod setting %s missing", s.Key)
		}
	}
	for _, bin := range input(t).Binaries {
		n := 0
		bin.Flags.VisitAll(func(f *pflag.Flag) {
			n++
			if !strings.Contains(text, "`--"+f.Name+"` | `"+flagenv.Name(bin.EnvPrefix, f.Name)+"`") {
				t.Errorf("%s flag --%s missing", bin.Name, f.Name)
			}
		})
		if n == 0 {
			t.Errorf("%s: no flags", bin.Name)
		}
	}
}

func TestValueRows(t *testing.T) {
	rows, err := valueRows([]byte(`# -- image registry
hub: example.io
repair:
  # on or off
  enabled: true
  # what to do
  action: repair
tolerations:
  - operator: Exists
empty: {}
str: ""
`))
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, r := range rows {
		got = append(got, r.path+"="+r.def+"="+r.doc)
	}
	want := []string{"hub=example.io=image registry", "repair.enabled=true=on or off", "repair.action=repair=what to do",
		"tolerations=[{operator: Exists}]=", "empty={}=", `str=""=`}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("rows:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if _, err := valueRows([]byte("a: [")); err == nil {
		t.Fatal("bad YAML: want an error")
	}
}
