package audit_test

import (
	"context"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes/fake"

	itestutil "github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/internal/testkit/traffic"
	"github.com/meshcni/meshcni/pkg/audit"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/sandboxstate"
)

// decisions are recorded ADD decisions by pod UID.
type decisions map[string]sandboxstate.Decision

func (d decisions) Decided(pod *corev1.Pod) (audit.Decision, string) {
	if x, ok := d[string(pod.UID)]; ok {
		return x, "recorded at ADD"
	}
	return "", ""
}

// TestSkippedAtAddNeverEscaped: a pod started with
// sidecar.istio.io/interceptionMode: NONE has no rules by design and, as Istio's
// injector makes it, no istio-validation. Its annotation removed, it looks like
// an escaped pod to anyone judging by its current annotations; the audit judging
// by its ADD's recorded decision leaves it alone over several rounds with the
// delete action, reports the change once, and its packets still reach its app
// directly. Without a record (a pod that never went through meshcni), the same
// pod is escaped: the legitimate case, for contrast.
func TestSkippedAtAddNeverEscaped(t *testing.T) {
	itestutil.RequireRoot(t)
	ctx := context.Background()
	net := traffic.NewPod(t)
	traffic.StartApp(t, net.NetNS, pod4, "pod-app")
	traffic.StartProxy(t, net.NetNS, traffic.ProxyOptions{})
	for _, tt := range []struct {
		name     string
		recorded decisions
		want     audit.Result
	}{
		{"ADD recorded skipped", decisions{"uid-none": sandboxstate.Skipped}, audit.Reported},
		{"no record: escaped", decisions{}, audit.Evicted},
	} {
		t.Run(tt.name, func(t *testing.T) {
			pod := owned(meshedPod("none", traffic.PodIPv4.String(), map[string]string{capture.AnnotationInterceptionMode: "NONE"}))
			pod.Spec.InitContainers = nil // Istio's injector adds no istio-validation to a NONE pod
			delete(pod.Annotations, capture.AnnotationInterceptionMode)
			client := fake.NewClientset(pod)
			p := &pods{list: []*corev1.Pod{pod}}
			a, rec, m := newAuditor(t, p, &netnsByName{paths: map[string]string{"none": net.NetNS}}, func(o *audit.Options) {
				o.EscapedAction, o.Client, o.Evictor, o.Decisions = audit.ActionEvict, client, evictor(client), tt.recorded
			})
			if st := a.Round(ctx); st[tt.want] != 1 {
				t.Fatalf("round: %v, want %s; events %q", st, tt.want, events(rec))
			}
			if tt.want == audit.Evicted {
				return
			}
			for i := range 3 {
				if st := a.Round(ctx); st[audit.Reported] != 1 {
					t.Fatalf("round %d: %v, want reported", i, st)
				}
			}
			for _, act := range client.Actions() {
				if act.GetVerb() != "get" && act.GetVerb() != "list" { // no eviction (a create), no delete
					t.Errorf("API action %s: want none", act.GetVerb())
				}
			}
			evs := events(rec)
			if len(evs) != 1 || !hasEvent(evs, audit.EventAnnotationsChanged, "ADD decided skipped", "nothing is changed or deleted") {
				t.Errorf("events %q: want one Warning %s", evs, audit.EventAnnotationsChanged)
			}
			if count(m, true, audit.ReasonAnnotationsChanged) != 1 || count(m, true, audit.ReasonNoRedirect) != 0 {
				t.Error("metrics: want one annotations-changed, no escape")
			}
			ans := traffic.Dial(t, net.PeerNetNS, pod4, traffic.DialOptions{Cred: appUser})
			if ans.App == nil || ans.App.Server != "pod-app" || ans.Proxy != nil {
				t.Errorf("the peer's connection: %+v, want the app directly", ans)
			}
		})
	}
}
