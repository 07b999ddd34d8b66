package audit

import (
	"reflect"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/engine"
	"github.com/meshcni/meshcni/pkg/sandboxstate"
	"github.com/meshcni/meshcni/pkg/spec"
)

func pod() *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "app", Name: "web", Annotations: map[string]string{capture.AnnotationStatus: "{}"}},
		Spec:       corev1.PodSpec{NodeName: "n1", Containers: []corev1.Container{{Name: capture.ProxyContainer}}},
		Status:     corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "10.0.0.5"},
	}
}

func TestAudited(t *testing.T) {
	now := metav1.Now()
	for _, tc := range []struct {
		name string
		mut  func(*corev1.Pod)
		want bool
	}{
		{"meshed and running", func(*corev1.Pod) {}, true},
		{"other node", func(p *corev1.Pod) { p.Spec.NodeName = "n2" }, false},
		{"being deleted", func(p *corev1.Pod) { p.DeletionTimestamp = &now }, false},
		{"host network", func(p *corev1.Pod) { p.Spec.HostNetwork = true }, false},
		{"pending", func(p *corev1.Pod) { p.Status.Phase = corev1.PodPending }, false},
		{"no IP", func(p *corev1.Pod) { p.Status.PodIP = "" }, false},
		{"skipped by the plugin: not injected", func(p *corev1.Pod) { p.Annotations = nil }, false},
		{"skipped by the plugin: inject=false", func(p *corev1.Pod) { p.Labels = map[string]string{capture.AnnotationInject: "false"} }, false},
		{"skipped by the plugin: istio-init", func(p *corev1.Pod) { p.Spec.InitContainers = []corev1.Container{{Name: capture.InitContainer}} }, false},
		{"skipped by the plugin: excluded namespace", func(p *corev1.Pod) { p.Namespace = "kube-system" }, false},
	} {
		p := pod()
		tc.mut(p)
		if got, why := Audited(p, "n1", capture.Config{ExcludeNamespaces: []string{"kube-system"}}); got != tc.want {
			t.Errorf("%s: %v (%s), want %v", tc.name, got, why, tc.want)
		}
	}
}

func TestJudge(t *testing.T) {
	drift := engine.Report{Drift: backend.Drift{Missing: []string{"x"}}, Findings: []engine.Finding{{Reason: engine.ReasonMissingChain}}}
	for _, tc := range []struct {
		name                         string
		r                            engine.Report
		absent, validation, recorded bool
		want                         Judgement
	}{
		{"clean", engine.Report{}, false, false, false, Judgement{}},
		{"drift", drift, false, true, false, Judgement{Drift: true, Action: ActionRepair, Reasons: []engine.Reason{engine.ReasonMissingChain}}},
		{"nothing left, validation container: repaired, the validation catches the next start", drift, true, true, false,
			Judgement{Drift: true, Action: ActionRepair, Reasons: []engine.Reason{engine.ReasonMissingChain}}},
		{"escaped", drift, true, false, false, Judgement{Drift: true, Escaped: true, Action: ActionEvict, Reasons: []engine.Reason{ReasonNoRedirect}}},
		{"nothing left, ADD recorded meshed: drift, not escaped", drift, true, false, true,
			Judgement{Drift: true, Action: ActionRepair, Reasons: []engine.Reason{engine.ReasonMissingChain}}},
	} {
		if got := Judge(tc.r, tc.absent, tc.validation, tc.recorded, ActionRepair, ActionEvict); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%s: %+v, want %+v", tc.name, got, tc.want)
		}
	}
}

func TestAbsent(t *testing.T) {
	chain := engine.Finding{Reason: engine.ReasonMissingChain}
	route := engine.Finding{Reason: engine.ReasonMissingRoute}
	some := engine.Finding{Reason: engine.ReasonMissingRule}
	for _, tc := range []struct {
		name string
		r    engine.Report
		want bool
	}{
		{"no drift", engine.Report{}, false},
		{"every chain and route gone", engine.Report{Findings: []engine.Finding{chain, route}}, true},
		{"a chain keeps rules", engine.Report{Findings: []engine.Finding{chain, some}}, false},
		{"something unexpected", engine.Report{Drift: backend.Drift{Unexpected: []string{"y"}}, Findings: []engine.Finding{chain}}, false},
	} {
		if got := Absent(tc.r); got != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestParseActions(t *testing.T) {
	if a, err := ParseAction(" report "); err != nil || a != ActionReport {
		t.Fatal(a, err)
	}
	if _, err := ParseAction("evict"); err == nil {
		t.Fatal("evict is for escaped pods only")
	}
	for s, want := range map[string]Action{"evict": ActionEvict, "delete": ActionEvict, "repair": ActionRepair, "report": ActionReport} {
		if a, err := ParseEscapedAction(s); err != nil || a != want {
			t.Fatal(s, a, err)
		}
	}
	if _, err := ParseEscapedAction("label"); err == nil {
		t.Fatal("label")
	}
}

func TestHash(t *testing.T) {
	a, b := spec.PodDefaults(), spec.PodDefaults()
	if Hash(&a) != Hash(&b) {
		t.Fatal("same spec, different hashes")
	}
	b.OutboundPortsExclude = []uint16{8080}
	if Hash(&a) == Hash(&b) {
		t.Fatal("different specs, same hash")
	}
}

func TestDecided(t *testing.T) {
	for _, tc := range []struct {
		recorded  Decision
		meshedNow bool
		want      Verdict
	}{
		{"", true, Check},
		{"", false, Skip},
		{sandboxstate.Meshed, true, Check},
		{sandboxstate.Meshed, false, Change},
		{sandboxstate.Skipped, false, Skip},
		{sandboxstate.Skipped, true, Change},
	} {
		if got := Decided(tc.recorded, tc.meshedNow); got != tc.want {
			t.Errorf("Decided(%q, meshed now %v) = %v, want %v", tc.recorded, tc.meshedNow, got, tc.want)
		}
	}
}
