package agent

import (
	"io"
	"log/slog"
	"net/netip"
	"path/filepath"
	"reflect"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/meshcni/meshcni/pkg/agentsock"
	"github.com/meshcni/meshcni/pkg/audit"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/capture/k8spod"
	"github.com/meshcni/meshcni/pkg/ebpf/sockmap"
	"github.com/meshcni/meshcni/pkg/sandboxstate"
)

// statePod is a meshed pod of the node's cache, running with an IP.
func statePod(name string, ann map[string]string) *corev1.Pod {
	a := map[string]string{capture.AnnotationStatus: `{"containers":["istio-proxy"]}`}
	for k, v := range ann {
		a[k] = v
	}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "app", Name: name, UID: types.UID("uid-" + name), Annotations: a},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "app"}, {Name: capture.ProxyContainer, Args: []string{"proxy", "sidecar"}}}},
		Status:     corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "10.1.0.5", PodIPs: []corev1.PodIP{{IP: "10.1.0.5"}}},
	}
}

// agentLife is one run of the agent's sandbox bookkeeping over a run directory
// that outlives it, and an allow-list that outlives it (the pinned map).
type agentLife struct {
	s *Sandboxes
	e *EBPF
}

func startLife(t *testing.T, dir string, f *fakeAccel, pods *mapPods) agentLife {
	t.Helper()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	s := &Sandboxes{Dir: dir, Pods: pods, Log: log}
	e := &EBPF{Default: capture.AccelOff, Log: log, accel: f, pods: map[string]ebpfPod{}, state: s}
	if st := s.Open(); st != nil {
		e.restore(st.List())
	} else {
		t.Fatal("store did not open")
	}
	return agentLife{s, e}
}

// OnCommand as the socket server runs it.
func (l agentLife) cmd(r *agentsock.CommandResult) {
	l.e.OnCommand(r)
	l.s.OnCommand(r)
}

func hashFor(t *testing.T, pod *corev1.Pod) string {
	t.Helper()
	res, err := capture.Config{}.ForPod(k8spod.From(pod), []netip.Addr{netip.MustParseAddr(pod.Status.PodIP)})
	if err != nil {
		t.Fatal(err)
	}
	return audit.Hash(res.Spec)
}

// TestSandboxesAcrossRestart: what a sandbox's ADD taught one agent (the spec its
// annotations gave, the cookie it enabled) the next agent knows: the spec the pod
// was redirected with, not its changed annotations, and the DEL takes the cookie
// off the allow-list (the fake stands for the pinned map, which outlives the
// agent; the kernel's side is TestEBPFRestartOnTestbed).
func TestSandboxesAcrossRestart(t *testing.T) {
	dir := filepath.Join(t.TempDir(), SandboxDirName)
	f := &fakeAccel{allow: map[uint64]sockmap.Pod{}}
	web := statePod("web", nil)
	pods := &mapPods{synced: true, pods: map[string]*corev1.Pod{"app/web": web}}
	first := startLife(t, dir, f, pods)
	first.cmd(add("sb-web", "app", "web", "to-proxy", 41))
	first.cmd(add("sb-web", "app", "web", "to-proxy", 41)) // repeated: one entry
	if _, ok := f.allow[41]; !ok {
		t.Fatal("cookie 41 not enabled")
	}
	applied := hashFor(t, web)

	// The agent is down; the annotations change.
	changed := statePod("web", map[string]string{capture.AnnotationExcludeOutboundPorts: "8080"})
	pods.pods["app/web"] = changed
	if hashFor(t, changed) == applied {
		t.Fatal("the changed annotation gives the same spec")
	}

	second := startLife(t, dir, f, pods)
	s, ok := second.s.Applied(changed)
	if !ok || audit.Hash(s) != applied {
		t.Fatalf("after the restart: applied spec known %v, hash %s; want the ADD's %s", ok, audit.Hash(s), applied)
	}
	if ok, _ := second.e.PodAccelerated("app", "web"); !ok {
		t.Error("after the restart: app/web not known as accelerated")
	}
	second.cmd(&agentsock.CommandResult{Command: agentsock.CommandDel, Result: agentsock.ResultSuccess, ContainerID: "sb-web", Pod: agentsock.Pod{Namespace: "app", Name: "web"}})
	if _, ok := f.allow[41]; ok {
		t.Error("cookie 41 still allowed after the DEL that followed a restart")
	}
	if n := second.s.get().Len(); n != 0 {
		t.Errorf("%d entries after the DEL", n)
	}
}

// TestSandboxesGC: a pod deleted while no agent ran is collected as soon as the
// cache synced, and its cookie disabled; so is a pod recreated under the same
// name (another UID); a pod still on the node stays; an entry this agent wrote
// for a pod the cache does not hold (yet) stays for the grace, then goes.
func TestSandboxesGC(t *testing.T) {
	dir := t.TempDir()
	f := &fakeAccel{allow: map[uint64]sockmap.Pod{}}
	pods := &mapPods{synced: true, pods: map[string]*corev1.Pod{}}
	for _, n := range []string{"gone", "kept", "recreated", "new"} {
		pods.pods["app/"+n] = statePod(n, nil)
	}
	first := startLife(t, dir, f, pods)
	first.cmd(add("sb-gone", "app", "gone", "to-proxy", 1))
	first.cmd(add("sb-kept", "app", "kept", "to-proxy", 2))
	first.cmd(add("sb-recreated", "app", "recreated", "to-proxy", 3))
	delete(pods.pods, "app/gone")
	pods.pods["app/recreated"].UID = "uid-newer"
	pods.synced = false
	time.Sleep(10 * time.Millisecond) // the next agent opens the store strictly later
	second := startLife(t, dir, f, pods)
	second.cmd(add("sb-new", "app", "new", "to-proxy", 4))
	delete(pods.pods, "app/new") // not in the cache yet
	if gone := second.s.GC(time.Now()); len(gone) != 0 {
		t.Fatalf("collected %v before the cache synced", gone)
	}
	pods.synced = true
	gone := second.s.GC(time.Now())
	for _, e := range gone {
		second.e.SandboxGone(e.ID)
	}
	if len(gone) != 2 || gone[0].ID != "sb-gone" || gone[1].ID != "sb-recreated" {
		t.Fatalf("collected %+v, want sb-gone and sb-recreated", gone)
	}
	if len(f.allow) != 2 || f.allow[2] == (sockmap.Pod{}) || f.allow[4] == (sockmap.Pod{}) {
		t.Errorf("allow-list %v, want cookies 2 (app/kept) and 4 (app/new)", f.allow)
	}
	if gone := second.s.GC(time.Now().Add(SandboxGCGrace + time.Second)); len(gone) != 1 || gone[0].ID != "sb-new" {
		t.Errorf("after the grace: collected %+v, want sb-new", gone)
	}
}

// TestSandboxesNotMeshed: an ADD of a pod the plugin does not redirect, or of
// another pod than the cached one, records no spec.
func TestSandboxesNotMeshed(t *testing.T) {
	plain := statePod("plain", nil)
	delete(plain.Annotations, capture.AnnotationStatus)
	pods := &mapPods{synced: true, pods: map[string]*corev1.Pod{"app/plain": plain, "app/web": statePod("web", nil)}}
	l := startLife(t, t.TempDir(), &fakeAccel{allow: map[uint64]sockmap.Pod{}}, pods)
	l.cmd(&agentsock.CommandResult{Command: agentsock.CommandAdd, Result: agentsock.ResultSuccess, ContainerID: "sb-plain", Pod: agentsock.Pod{Namespace: "app", Name: "plain"}})
	other := add("sb-web", "app", "web", "", 5)
	other.EBPF.PodUID = "uid-older"
	l.cmd(other)
	for _, e := range l.s.get().List() {
		if e.Spec != nil {
			t.Errorf("sandbox %s: spec recorded", e.ID)
		}
	}
}

// TestSandboxesRecordDecision: every ADD the plugin reports is recorded with its
// decision, its reason and its netns identity, meshed (with the spec) or skipped
// (without one), and survives the agent's restart; a report whose netns identity
// could not be read records none.
func TestSandboxesRecordDecision(t *testing.T) {
	none := statePod("none", map[string]string{capture.AnnotationInterceptionMode: "NONE"})
	pods := &mapPods{synced: true, pods: map[string]*corev1.Pod{"app/none": none, "app/web": statePod("web", nil)}}
	dir := t.TempDir()
	l := startLife(t, dir, &fakeAccel{allow: map[uint64]sockmap.Pod{}}, pods)
	report := func(id, name, decision, reason string, inode uint64) *agentsock.CommandResult {
		return &agentsock.CommandResult{Command: agentsock.CommandAdd, Result: agentsock.ResultSuccess, ContainerID: id,
			Pod: agentsock.Pod{Namespace: "app", Name: name},
			Sandbox: &agentsock.Sandbox{PodUID: "uid-" + name, Decision: decision, Reason: reason,
				Netns: "/var/run/netns/cni-" + id, NetnsDev: 4, NetnsInode: inode, NetnsCookie: inode + 1}}
	}
	l.cmd(report("sb-none", "none", agentsock.DecisionSkipped, "sidecar.istio.io/interceptionMode=NONE: the proxy captures no traffic", 4026532001))
	l.cmd(report("sb-web", "web", agentsock.DecisionMeshed, "injected", 4026532002))
	l.cmd(report("sb-gone", "gone", agentsock.DecisionSkipped, "namespace gone is excluded", 0))
	next := startLife(t, dir, &fakeAccel{allow: map[uint64]sockmap.Pod{}}, pods)
	for _, tt := range []struct {
		id       string
		decision sandboxstate.Decision
		netns    *sandboxstate.Netns
		spec     bool
	}{
		{"sb-none", sandboxstate.Skipped, &sandboxstate.Netns{Path: "/var/run/netns/cni-sb-none", Dev: 4, Inode: 4026532001, Cookie: 4026532002}, false},
		{"sb-web", sandboxstate.Meshed, &sandboxstate.Netns{Path: "/var/run/netns/cni-sb-web", Dev: 4, Inode: 4026532002, Cookie: 4026532003}, true},
		{"sb-gone", sandboxstate.Skipped, nil, false},
	} {
		e, ok := next.s.get().Get(tt.id)
		if !ok {
			t.Errorf("%s: not recorded", tt.id)
			continue
		}
		if e.Decision != tt.decision || e.Reason == "" || (e.Spec != nil) != tt.spec || !reflect.DeepEqual(e.Netns, tt.netns) || e.UID == "" {
			t.Errorf("%s: %+v (netns %+v), want decision %s, a reason, a UID, spec %v, netns %+v", tt.id, e, e.Netns, tt.decision, tt.spec, tt.netns)
		}
	}
}
