package audit_test

// The audit over real network namespaces and the real backends: drift made from the
// node (tables flushed, a rule changed, a foreign rule in meshcni's chain, the
// TPROXY route deleted) is detected, named and repaired, and real packets reach the
// UID 1337 proxy again with their original destination; other owners' tables and
// chains are left alone; report mode changes nothing.

import (
	"context"
	"net/netip"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/record"

	"github.com/meshcni/meshcni/internal/standin/proxysim"
	itestutil "github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/internal/testkit/traffic"
	"github.com/meshcni/meshcni/pkg/audit"
	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/capture/k8spod"
	"github.com/meshcni/meshcni/pkg/engine"
	"github.com/meshcni/meshcni/pkg/spec"
)

var (
	appUser = traffic.Cred{UID: 1000, GID: 1000}
	peer4   = netip.AddrPortFrom(traffic.PeerIPv4, 8080)
	pod4    = netip.AddrPortFrom(traffic.PodIPv4, 9090)
)

var backends = []backend.Kind{backend.Nftables, backend.IptablesNft, backend.IptablesLegacy}

// scratch is one meshed pod in scratch namespaces: its netns with the stand-in proxy
// (UID 1337), an app on 9090, a peer app on 8080, its redirect applied with kind.
type scratch struct {
	pod  *corev1.Pod
	net  *traffic.Pod
	kind backend.Kind
}

func newScratch(t *testing.T, kind backend.Kind, name string, ann map[string]string) *scratch {
	t.Helper()
	pod := meshedPod(name, traffic.PodIPv4.String(), ann)
	net := traffic.NewPod(t)
	traffic.StartApp(t, net.PeerNetNS, netip.MustParseAddrPort("[::]:8080"), "peer-app")
	traffic.StartApp(t, net.NetNS, netip.MustParseAddrPort("[::]:9090"), "pod-app")
	traffic.StartProxy(t, net.NetNS, traffic.ProxyOptions{TPROXY: ann[capture.AnnotationInterceptionMode] == "TPROXY"})
	res, err := capture.Config{}.ForPod(k8spod.From(pod), []netip.Addr{traffic.PodIPv4})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := engine.Apply(context.Background(), engine.Options{Backend: kind, NetnsPath: net.NetNS}, res.Spec); err != nil {
		t.Fatalf("apply: %v", err)
	}
	return &scratch{pod: pod, net: net, kind: kind}
}

// run runs a tool of the backend's family in the pod's namespace.
func (s *scratch) run(t *testing.T, tool string, args ...string) string {
	t.Helper()
	return string(traffic.MustRun(t, s.net.NetNS, itestutil.RequireBinary(t, tool), args...))
}

func (s *scratch) iptables(t *testing.T, args ...string) string {
	return s.run(t, string(s.kind), args...) // iptables-nft, iptables-legacy
}

// addForeign puts another owner's table and chain in the namespace; foreignHere
// reports whether they are intact.
func (s *scratch) addForeign(t *testing.T) {
	if s.kind == backend.Nftables {
		s.run(t, "nft", "add table inet foreign; add chain inet foreign keep; add rule inet foreign keep counter comment \"other owner\"")
		return
	}
	s.iptables(t, "-t", "filter", "-N", "FOREIGN")
	s.iptables(t, "-t", "filter", "-A", "FOREIGN", "-m", "comment", "--comment", "other owner", "-j", "RETURN")
}

func (s *scratch) foreignHere(t *testing.T) bool {
	if s.kind == backend.Nftables {
		return strings.Contains(s.run(t, "nft", "list", "table", "inet", "foreign"), "other owner")
	}
	return strings.Contains(s.iptables(t, "-t", "filter", "-S", "FOREIGN"), "other owner")
}

// outboundCaptured: the app's connection to the peer reaches the proxy's outbound
// listener with its original destination.
func (s *scratch) outboundCaptured(t *testing.T) bool {
	a := traffic.Dial(t, s.net.NetNS, peer4, traffic.DialOptions{Cred: appUser, Timeout: time.Second})
	return a.Listener() == proxysim.ListenerOutbound && a.OrigDst() == peer4
}

// inboundCaptured: the peer's connection to the pod's app reaches the proxy's
// inbound listener with its original destination.
func (s *scratch) inboundCaptured(t *testing.T) bool {
	a := traffic.Dial(t, s.net.PeerNetNS, pod4, traffic.DialOptions{Cred: appUser, Timeout: time.Second})
	return a.Listener() == proxysim.ListenerInbound && a.OrigDst() == pod4
}

var handleRE = regexp.MustCompile(`# handle (\d+)`)

// drifts are the changes made from the node, per backend.
var drifts = []struct {
	name   string
	tproxy bool
	reason engine.Reason
	make   func(t *testing.T, s *scratch)
}{
	{"tables flushed", false, engine.ReasonMissingChain, func(t *testing.T, s *scratch) {
		if s.kind == backend.Nftables {
			s.run(t, "nft", "delete", "table", "inet", "istio-proxy-nat")
			return
		}
		s.iptables(t, "-t", "nat", "-F")
		s.iptables(t, "-t", "nat", "-X")
	}},
	{"one rule changed", false, engine.ReasonChangedRule, func(t *testing.T, s *scratch) {
		if s.kind == backend.Nftables {
			out := s.run(t, "nft", "-a", "list", "chain", "inet", "istio-proxy-nat", "istio-redirect")
			var handle string
			for _, l := range strings.Split(out, "\n") {
				if m := handleRE.FindStringSubmatch(l); m != nil && strings.Contains(l, "redirect to :15001") {
					handle = m[1]
				}
			}
			if handle == "" {
				t.Fatalf("no redirect rule in:\n%s", out)
			}
			s.run(t, "nft", "replace", "rule", "inet", "istio-proxy-nat", "istio-redirect", "handle", handle, "meta", "l4proto", "tcp", "redirect", "to", ":15999")
			return
		}
		s.iptables(t, "-t", "nat", "-R", "ISTIO_REDIRECT", "1", "-p", "tcp", "-j", "REDIRECT", "--to-ports", "15999")
	}},
	{"foreign rule in our chain", false, engine.ReasonForeignRule, func(t *testing.T, s *scratch) {
		if s.kind == backend.Nftables {
			s.run(t, "nft", "insert", "rule", "inet", "istio-proxy-nat", "istio-output", "ip", "daddr", traffic.PeerIPv4.String(), "return")
			return
		}
		s.iptables(t, "-t", "nat", "-I", "ISTIO_OUTPUT", "1", "-d", traffic.PeerIPv4.String()+"/32", "-j", "RETURN")
	}},
	{"TPROXY route deleted", true, engine.ReasonMissingRoute, func(t *testing.T, s *scratch) {
		s.run(t, "ip", "-4", "route", "flush", "table", "133")
	}},
}

func newAuditor(t testing.TB, p *pods, n *netnsByName, mut func(*audit.Options)) (*audit.Auditor, *record.FakeRecorder, *audit.Metrics) {
	t.Helper()
	return newAuditorWith(t, p, n, mut)
}

func newAuditorWith(t testing.TB, p *pods, n audit.Netns, mut func(*audit.Options)) (*audit.Auditor, *record.FakeRecorder, *audit.Metrics) {
	t.Helper()
	rec := record.NewFakeRecorder(1000)
	m, err := audit.NewMetrics(nil)
	if err != nil {
		t.Fatal(err)
	}
	o := audit.Options{Node: node, Pods: p, Netns: n, Events: rec, Metrics: m, Concurrency: 4}
	if mut != nil {
		mut(&o)
	}
	a, err := audit.New(o)
	if err != nil {
		t.Fatal(err)
	}
	return a, rec, m
}

func TestDriftDetectedAndRepaired(t *testing.T) {
	itestutil.RequireRoot(t)
	ctx := context.Background()
	for _, kind := range backends {
		for _, d := range drifts {
			t.Run(string(kind)+"/"+d.name, func(t *testing.T) {
				ann := map[string]string{}
				if d.tproxy {
					ann[capture.AnnotationInterceptionMode] = "TPROXY"
				}
				s := newScratch(t, kind, "web", ann)
				s.addForeign(t)
				p := &pods{list: []*corev1.Pod{s.pod}}
				a, rec, m := newAuditor(t, p, &netnsByName{paths: map[string]string{"web": s.net.NetNS}}, nil)
				if st := a.Round(ctx); st[audit.Clean] != 1 {
					t.Fatalf("first round: %v, want the pod clean", st)
				}
				d.make(t, s)
				// (Without the TPROXY route, inbound to the pod's own address is still
				// delivered locally: the route matters for other destinations, so
				// only the check sees that drift.)
				if !d.tproxy && s.outboundCaptured(t) {
					t.Fatalf("after %s the pod is still captured: the drift made breaks nothing", d.name)
				}
				if st := a.Round(ctx); st[audit.Repaired] != 1 {
					t.Fatalf("round after %s: %v, want the pod repaired; events %q", d.name, st, events(rec))
				}
				evs := events(rec)
				if !hasEvent(evs, audit.EventDrift, string(d.reason), "re-applied in place") {
					t.Errorf("events %q: want a Warning %s naming %s", evs, audit.EventDrift, d.reason)
				}
				if count(m, true, d.reason) != 1 || count(m, false, d.reason) != 1 {
					t.Errorf("metrics for %s: detected %d repaired %d, want 1 and 1", d.reason, count(m, true, d.reason), count(m, false, d.reason))
				}
				if st := a.Round(ctx); st[audit.Clean] != 1 {
					t.Errorf("round after the repair: %v, want the pod clean", st)
				}
				if !s.outboundCaptured(t) {
					t.Error("after the repair the app's outbound connection does not reach the proxy with its original destination")
				}
				if d.tproxy && !s.inboundCaptured(t) {
					t.Error("after the repair inbound does not reach the proxy by TPROXY with its original destination")
				}
				if !s.foreignHere(t) {
					t.Error("another owner's table/chain was touched")
				}
				live, err := engine.Live(ctx, engine.Options{NetnsPath: s.net.NetNS})
				if err != nil || strings.TrimSpace(live[kind]) == "" {
					t.Errorf("live rules after repair: %v, %v: want %s's", live, err, kind)
				}
			})
		}
	}
}

func TestReportModeChangesNothing(t *testing.T) {
	itestutil.RequireRoot(t)
	ctx := context.Background()
	for _, kind := range backends {
		t.Run(string(kind), func(t *testing.T) {
			s := newScratch(t, kind, "web", nil)
			p := &pods{list: []*corev1.Pod{s.pod}}
			a, rec, m := newAuditor(t, p, &netnsByName{paths: map[string]string{"web": s.net.NetNS}}, func(o *audit.Options) {
				o.Action = audit.ActionReport
			})
			a.Round(ctx)
			drifts[2].make(t, s) // a foreign rule in our chain: the peer is not captured
			before, _ := engine.Live(ctx, engine.Options{NetnsPath: s.net.NetNS})
			for i := range 3 {
				if st := a.Round(ctx); st[audit.Reported] != 1 {
					t.Fatalf("round %d: %v, want reported", i, st)
				}
			}
			after, _ := engine.Live(ctx, engine.Options{NetnsPath: s.net.NetNS})
			if before[kind] != after[kind] {
				t.Errorf("report mode changed the rules:\n%s\n---\n%s", before[kind], after[kind])
			}
			if s.outboundCaptured(t) {
				t.Error("report mode: the foreign RETURN rule must still let the connection bypass the proxy")
			}
			evs := events(rec)
			if len(evs) != 1 || !hasEvent(evs, audit.EventDrift, string(engine.ReasonForeignRule), "reported only") {
				t.Errorf("events %q: want one Warning %s (not one per round)", evs, audit.EventDrift)
			}
			if count(m, true, engine.ReasonForeignRule) != 1 || count(m, false, engine.ReasonForeignRule) != 0 {
				t.Error("metrics: want detected 1, repaired 0")
			}
		})
	}
}

// TestEscapedPod: a meshed pod with no redirect at all, no validation init
// container and no record is repaired (default), evicted, or reported, as
// configured.
func TestEscapedPod(t *testing.T) {
	itestutil.RequireRoot(t)
	ctx := context.Background()
	for _, action := range []audit.Action{audit.ActionEvict, audit.ActionRepair, audit.ActionReport} {
		t.Run(string(action), func(t *testing.T) {
			pod := owned(meshedPod("escaped", traffic.PodIPv4.String(), nil))
			pod.Spec.InitContainers = nil
			net := traffic.NewPod(t)
			traffic.StartApp(t, net.PeerNetNS, netip.MustParseAddrPort("[::]:8080"), "peer-app")
			traffic.StartProxy(t, net.NetNS, traffic.ProxyOptions{})
			cs := fake.NewClientset(pod)
			p := &pods{list: []*corev1.Pod{pod}}
			a, rec, m := newAuditor(t, p, &netnsByName{paths: map[string]string{"escaped": net.NetNS}}, func(o *audit.Options) {
				o.EscapedAction = action
				o.Client, o.Evictor = cs, evictor(cs)
			})
			st := a.Round(ctx)
			want := map[audit.Action]audit.Result{audit.ActionEvict: audit.Evicted, audit.ActionRepair: audit.Repaired, audit.ActionReport: audit.Reported}[action]
			if st[want] != 1 {
				t.Fatalf("round: %v, want %s", st, want)
			}
			if !hasEvent(events(rec), audit.EventEscaped, "no istio-validation init container") {
				t.Error("no Warning " + audit.EventEscaped)
			}
			if count(m, true, audit.ReasonNoRedirect) != 1 {
				t.Error("meshcni_drift_detected_total{reason=no-redirect} != 1")
			}
			_, err := cs.CoreV1().Pods("app").Get(ctx, "escaped", metav1.GetOptions{})
			if deleted := err != nil; deleted != (action == audit.ActionEvict) {
				t.Errorf("pod deleted: %v, want %v", deleted, action == audit.ActionEvict)
			}
			s := &scratch{pod: pod, net: net}
			if got := s.outboundCaptured(t); got != (action == audit.ActionRepair) {
				t.Errorf("outbound captured: %v, want %v", got, action == audit.ActionRepair)
			}
		})
	}
}

// TestAnnotationChange: a changed annotation on a running pod is reported, not
// applied; with FollowAnnotations it is applied.
func TestAnnotationChange(t *testing.T) {
	itestutil.RequireRoot(t)
	ctx := context.Background()
	for _, follow := range []bool{false, true} {
		t.Run(map[bool]string{false: "reported", true: "followed"}[follow], func(t *testing.T) {
			s := newScratch(t, backend.Nftables, "web", nil)
			p := &pods{list: []*corev1.Pod{s.pod}}
			a, rec, m := newAuditor(t, p, &netnsByName{paths: map[string]string{"web": s.net.NetNS}}, func(o *audit.Options) {
				o.FollowAnnotations = follow
			})
			a.Round(ctx)
			changed := s.pod.DeepCopy()
			changed.Annotations[capture.AnnotationExcludeOutboundPorts] = "8080"
			p.set(changed)
			st := a.Round(ctx)
			a.Round(ctx)
			if follow {
				if st[audit.Repaired] != 1 || s.outboundCaptured(t) {
					t.Errorf("round %v: want the new spec applied (8080 no longer captured)", st)
				}
				if count(m, false, audit.ReasonAnnotationsChanged) != 1 {
					t.Error("repaired{annotations-changed} != 1")
				}
				return
			}
			if st[audit.Reported] != 1 || !s.outboundCaptured(t) {
				t.Errorf("round %v: want reported, the old redirect kept (8080 captured)", st)
			}
			evs := events(rec)
			if len(evs) != 1 || !hasEvent(evs, audit.EventAnnotationsChanged) {
				t.Errorf("events %q: want one %s", evs, audit.EventAnnotationsChanged)
			}
			if count(m, true, audit.ReasonAnnotationsChanged) != 1 || count(m, false, audit.ReasonAnnotationsChanged) != 0 {
				t.Error("metrics: want detected 1, repaired 0")
			}
		})
	}
}

// applied is the agent's memory of the specs pods were redirected with (its
// sandbox state), which outlives one auditor.
type applied struct {
	mu    sync.Mutex
	specs map[types.UID]*spec.Spec
}

func (m *applied) Applied(pod *corev1.Pod) (*spec.Spec, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	s, ok := m.specs[pod.UID]
	if !ok {
		return nil, false
	}
	c := *s // the auditor keeps what it gets
	return &c, true
}

func (m *applied) Remember(pod *corev1.Pod, s *spec.Spec) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.specs[pod.UID] = s
}

// TestAnnotationChangeAcrossRestart: the annotations change while the agent is
// down; the next auditor (a new agent) reports the change against the spec the
// pod was redirected with, which the agent remembered, and keeps the redirect
// (8080 still captured). Without that memory the new auditor takes the new
// annotations for the pod's spec and rewrites the redirect: the weakness the
// memory removes.
func TestAnnotationChangeAcrossRestart(t *testing.T) {
	itestutil.RequireRoot(t)
	ctx := context.Background()
	for _, remembered := range []bool{true, false} {
		t.Run(map[bool]string{true: "remembered", false: "forgotten"}[remembered], func(t *testing.T) {
			s := newScratch(t, backend.Nftables, "web", nil)
			p := &pods{list: []*corev1.Pod{s.pod}}
			n := &netnsByName{paths: map[string]string{"web": s.net.NetNS}}
			mem := &applied{specs: map[types.UID]*spec.Spec{}}
			withMemory := func(o *audit.Options) {
				if remembered {
					o.Applied = mem
				}
			}
			before, _, _ := newAuditor(t, p, n, withMemory)
			if st := before.Round(ctx); st[audit.Clean] != 1 {
				t.Fatalf("first agent's round %v", st)
			}
			if remembered && len(mem.specs) != 1 {
				t.Fatalf("the first audit remembered %d specs, want the pod's", len(mem.specs))
			}
			changed := s.pod.DeepCopy() // while no agent runs
			changed.Annotations[capture.AnnotationExcludeOutboundPorts] = "8080"
			p.set(changed)
			after, rec, m := newAuditor(t, p, n, withMemory)
			st := after.Round(ctx)
			evs := events(rec)
			if !remembered {
				if st[audit.Repaired] != 1 || s.outboundCaptured(t) {
					t.Errorf("round %v: without memory the new annotations are taken as the pod's spec and applied", st)
				}
				return
			}
			if st[audit.Reported] != 1 || !s.outboundCaptured(t) {
				t.Errorf("round %v: want the change reported and the redirect kept (8080 captured)", st)
			}
			if len(evs) != 1 || !hasEvent(evs, audit.EventAnnotationsChanged) {
				t.Errorf("events %q: want one %s", evs, audit.EventAnnotationsChanged)
			}
			if count(m, true, audit.ReasonAnnotationsChanged) != 1 || count(m, false, audit.ReasonAnnotationsChanged) != 0 {
				t.Error("metrics: want detected{annotations-changed} 1, repaired 0")
			}
		})
	}
}
