package agent

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/meshcni/meshcni/pkg/agentsock"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/capture/k8spod"
	"github.com/meshcni/meshcni/pkg/podnetns"
	"github.com/meshcni/meshcni/pkg/sandboxstate"
	"github.com/meshcni/meshcni/pkg/spec"
)

// SandboxDirName is the directory of the per-sandbox state in the run directory.
const SandboxDirName = "sandboxes"

// Sandbox state collection: entries of sandboxes whose pod left the node are
// removed once the pod cache synced and every SandboxGCPeriod after. An entry
// this agent wrote less than SandboxGCGrace ago stays (its pod may not be in the
// cache yet); one an earlier agent wrote is judged by the synced cache at once.
const (
	SandboxGCPeriod = 10 * time.Minute
	SandboxGCGrace  = 2 * time.Minute
)

// Sandboxes is the agent's memory of each pod sandbox across its own restarts
// (pkg/sandboxstate, in the run directory): at a sandbox's successful ADD, meshed
// or not, the pod's UID, what the ADD decided and why, the identity of the
// sandbox's network namespace (as the plugin read it from CNI_NETNS) and, for a
// meshed pod, the redirect spec its annotations gave (from the node's pod cache);
// from EBPF, the netns cookie it enabled; removed at the sandbox's DEL, when its
// pod is deleted, and collected for pods no longer on the node. The audit and the
// repair find a pod's netns by its record and judge it against the recorded
// decision and spec (Records); EBPF disables at DEL what an earlier agent
// enabled. The record is written by the socket server's goroutine after the
// plugin sent its result: the ADD does not wait for it. Without the store (Open
// failed) the agent runs as without memory: the audit takes a pod's annotations
// at its first check, and pods enabled before a restart stay on the eBPF
// allow-list until the node's programs are removed.
type Sandboxes struct {
	Dir  string
	Pods PodSource // nil: no spec is recorded and nothing collected
	Mesh capture.Config
	Log  *slog.Logger

	mu     sync.Mutex
	store  *sandboxstate.Store // nil until Open, or when it failed
	opened time.Time           // entries updated before were written by an earlier agent
}

// Open loads the store; a failure is logged and the agent runs without it.
func (s *Sandboxes) Open() *sandboxstate.Store {
	st, err := sandboxstate.Open(s.Dir, sandboxstate.Options{})
	if err != nil {
		s.Log.Warn("per-sandbox state unavailable: after a restart the audit takes pods' annotations as their redirect and pods accelerated before stay enabled until removed", "dir", s.Dir, "err", err)
		return nil
	}
	for _, why := range st.Skipped() {
		s.Log.Warn("per-sandbox state: file skipped", "err", why)
	}
	s.Log.Info("per-sandbox state loaded", "dir", s.Dir, "sandboxes", st.Len(), "skipped", len(st.Skipped()))
	s.mu.Lock()
	s.store, s.opened = st, time.Now()
	s.mu.Unlock()
	return st
}

func (s *Sandboxes) get() *sandboxstate.Store {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.store
}

// OnCommand records a successful ADD's decision, netns and spec and forgets a sandbox at its DEL
// (after EBPF, which reads the sandbox's cookie).
func (s *Sandboxes) OnCommand(r *agentsock.CommandResult) {
	st := s.get()
	if st == nil || r.ContainerID == "" {
		return
	}
	switch {
	case r.Command == agentsock.CommandAdd && r.Result == agentsock.ResultSuccess:
		s.added(st, r)
	case r.Command == agentsock.CommandDel:
		if err := st.Delete(r.ContainerID); err != nil {
			s.Log.Warn("per-sandbox state: forget", "pod_namespace", r.Pod.Namespace, "pod_name", r.Pod.Name, "err", err)
		}
	}
}

// added records what a sandbox's ADD decided (meshed or skipped, why), its
// network namespace's identity and, for a meshed pod, the spec its annotations
// give as the pod cache holds it at the ADD (the plugin's result carries no spec).
// A plugin that reports no decision: the spec of a meshed pod only.
func (s *Sandboxes) added(st *sandboxstate.Store, r *agentsock.CommandResult) {
	if r.Pod.Namespace == "" || r.Pod.Name == "" {
		return
	}
	uid := ""
	if r.Sandbox != nil {
		uid = r.Sandbox.PodUID
	}
	if uid == "" && r.EBPF != nil {
		uid = r.EBPF.PodUID
	}
	pod := s.cached(r.Pod.Namespace, r.Pod.Name, uid)
	if r.Sandbox == nil && pod == nil {
		return
	}
	if uid == "" && pod != nil {
		uid = string(pod.UID)
	}
	sp, meshed := s.spec(pod)
	if r.Sandbox == nil && !meshed {
		return
	}
	err := st.Update(r.ContainerID, func(e *sandboxstate.Entry) {
		e.Namespace, e.Name, e.UID = r.Pod.Namespace, r.Pod.Name, uid
		if sb := r.Sandbox; sb != nil {
			e.Decision, e.Reason, e.Netns = sandboxstate.Decision(sb.Decision), sb.Reason, recordedNetns(sb)
			if sb.Decision != agentsock.DecisionMeshed {
				sp = nil
			}
		}
		e.Spec = sp
	})
	if err != nil {
		s.Log.Warn("per-sandbox state: record the sandbox's ADD", "pod_namespace", r.Pod.Namespace, "pod_name", r.Pod.Name, "sandbox", r.ContainerID, "err", err)
	}
}

// cached is the pod of the cache, nil when absent or of another UID than uid.
func (s *Sandboxes) cached(namespace, name, uid string) *corev1.Pod {
	if s.Pods == nil {
		return nil
	}
	pod, ok := s.Pods.Get(namespace, name)
	if !ok || (uid != "" && !capture.IsRuntimePod(k8spod.From(pod), uid)) {
		return nil // the cache holds another pod of that name
	}
	return pod
}

// spec is the redirect the pod's annotations give, when they mesh it.
func (s *Sandboxes) spec(pod *corev1.Pod) (*spec.Spec, bool) {
	if pod == nil {
		return nil, false
	}
	p := k8spod.From(pod)
	if !capture.Decide(p, s.Mesh).Captured() {
		return nil, false
	}
	res, err := s.Mesh.Build(p)
	if err != nil {
		return nil, false
	}
	return res.Spec, true
}

// recordedNetns is the reported netns identity, nil when the plugin could not
// read it.
func recordedNetns(sb *agentsock.Sandbox) *sandboxstate.Netns {
	if sb.NetnsInode == 0 {
		return nil
	}
	return &sandboxstate.Netns{Path: sb.Netns, Dev: sb.NetnsDev, Inode: sb.NetnsInode, Cookie: sb.NetnsCookie}
}

// newest is the latest entry of pod with a spec.
func newest(st *sandboxstate.Store, pod *corev1.Pod) (sandboxstate.Entry, bool) {
	var best sandboxstate.Entry
	found := false
	for _, e := range st.Select(func(e *sandboxstate.Entry) bool { return e.UID == string(pod.UID) && e.Spec != nil }) {
		if !found || e.Updated.After(best.Updated) {
			best, found = e, true
		}
	}
	return best, found
}

// Applied implements audit.AppliedSpecs: the spec recorded for the pod's newest
// sandbox, with the families of its addresses.
func (s *Sandboxes) Applied(pod *corev1.Pod) (*spec.Spec, bool) {
	st := s.get()
	if st == nil {
		return nil, false
	}
	e, ok := newest(st, pod)
	if !ok {
		return nil, false
	}
	ips, err := podnetns.PodIPs(pod)
	if err != nil {
		return nil, false
	}
	capture.WithFamilies(e.Spec, ips)
	return e.Spec, true
}

// Remember implements audit.AppliedSpecs: the spec replaces the one recorded for
// the pod's newest sandbox (none recorded: the sandbox is unknown, nothing kept).
func (s *Sandboxes) Remember(pod *corev1.Pod, sp *spec.Spec) {
	st := s.get()
	if st == nil {
		return
	}
	var id string
	var at time.Time
	for _, e := range st.Select(func(e *sandboxstate.Entry) bool { return e.UID == string(pod.UID) }) {
		if id == "" || e.Updated.After(at) {
			id, at = e.ID, e.Updated
		}
	}
	if id == "" {
		return
	}
	if err := st.Update(id, func(e *sandboxstate.Entry) { e.Spec = sp }); err != nil {
		s.Log.Warn("per-sandbox state: record the redirect", "pod_namespace", pod.Namespace, "pod_name", pod.Name, "err", err)
	}
}

// podDeleted forgets the sandboxes of a deleted pod (a missed DEL).
func (s *Sandboxes) podDeleted(pod *corev1.Pod) {
	st := s.get()
	if st == nil {
		return
	}
	if _, err := st.GC(func(e sandboxstate.Entry) bool {
		return e.Namespace != pod.Namespace || e.Name != pod.Name || (e.UID != "" && e.UID != string(pod.UID))
	}); err != nil {
		s.Log.Warn("per-sandbox state: forget a deleted pod", "pod_namespace", pod.Namespace, "pod_name", pod.Name, "err", err)
	}
}

// watch forgets a pod's sandboxes when the pod leaves the node's cache.
func (s *Sandboxes) watch(inf cache.SharedIndexInformer) error {
	_, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{DeleteFunc: func(obj any) {
		if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
			obj = d.Obj
		}
		if p, ok := obj.(*corev1.Pod); ok {
			s.podDeleted(p)
		}
	}})
	if err != nil {
		return fmt.Errorf("per-sandbox state: watch pod deletions: %w", err)
	}
	return nil
}

// GC removes the entries of pods no longer on the node (the cache synced) and
// returns them.
func (s *Sandboxes) GC(now time.Time) []sandboxstate.Entry {
	st := s.get()
	if st == nil || s.Pods == nil || !s.Pods.HasSynced() {
		return nil
	}
	gone, err := st.GC(func(e sandboxstate.Entry) bool {
		if e.Updated.After(s.opened) && now.Sub(e.Updated) < SandboxGCGrace {
			return true // written by this agent: its pod may not be cached yet
		}
		pod, ok := s.Pods.Get(e.Namespace, e.Name)
		return ok && (e.UID == "" || string(pod.UID) == e.UID)
	})
	if err != nil {
		s.Log.Warn("per-sandbox state: collect", "err", err)
	}
	for _, e := range gone {
		s.Log.Info("per-sandbox state: pod gone from the node, sandbox forgotten", "pod_namespace", e.Namespace, "pod_name", e.Name, "sandbox", e.ID)
	}
	return gone
}

// sandboxGC is the Runnable collecting the store: once the pod cache synced, then
// every SandboxGCPeriod; what it collects, EBPF disables.
type sandboxGC struct {
	s     *Sandboxes
	ebpf  *EBPF
	sync  func(context.Context) bool
	every time.Duration
}

func (g *sandboxGC) Name() string { return "sandbox state" }

func (g *sandboxGC) Run(ctx context.Context) error {
	if !g.sync(ctx) {
		return nil
	}
	t := time.NewTicker(g.every)
	defer t.Stop()
	for {
		for _, e := range g.s.GC(time.Now()) {
			g.ebpf.SandboxGone(e.ID)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// sandboxDir is the store's directory in the run directory.
func sandboxDir(runDir string) string { return filepath.Join(runDir, SandboxDirName) }

// restore takes back the sandboxes an earlier agent enabled (their cookies still
// on the allow-list), so that their DEL or their pod's deletion disables them.
func (e *EBPF) restore(entries []sandboxstate.Entry) {
	if !e.Available() {
		return
	}
	n := 0
	for _, s := range entries {
		if s.NetnsCookie == 0 {
			continue
		}
		if on, err := e.accel.Enabled(s.NetnsCookie); err != nil || !on {
			continue
		}
		e.mu.Lock()
		e.pods[s.ID] = ebpfPod{namespace: s.Namespace, name: s.Name, uid: s.UID, cookie: s.NetnsCookie}
		e.mu.Unlock()
		n++
	}
	if n > 0 {
		e.Log.Info("eBPF acceleration: sandboxes enabled before the restart taken back", "sandboxes", n)
	}
}

// SandboxGone disables a sandbox whose pod left the node while no agent ran.
func (e *EBPF) SandboxGone(id string) {
	if e.Available() {
		e.disable(id)
	}
}

// enabled records the cookie of a sandbox EBPF enabled.
func (s *Sandboxes) enabled(id string, p ebpfPod, mode capture.Acceleration) {
	st := s.get()
	if st == nil {
		return
	}
	err := st.Update(id, func(e *sandboxstate.Entry) {
		e.Namespace, e.Name, e.NetnsCookie, e.EBPFMode = p.namespace, p.name, p.cookie, string(mode)
		if e.UID == "" {
			e.UID = p.uid
		}
	})
	if err != nil {
		s.Log.Warn("per-sandbox state: record the eBPF netns cookie", "pod_namespace", p.namespace, "pod_name", p.name, "err", err)
	}
}

// PodSandbox implements podnetns.Records: the pod's newest recorded sandbox.
func (s *Sandboxes) PodSandbox(podUID string) (podnetns.Sandbox, bool) {
	st := s.get()
	if st == nil || podUID == "" {
		return podnetns.Sandbox{}, false
	}
	var best sandboxstate.Entry
	found := false
	for _, e := range st.Select(func(e *sandboxstate.Entry) bool { return e.UID == podUID }) {
		if !found || e.Updated.After(best.Updated) {
			best, found = e, true
		}
	}
	return locatable(best), found
}

// Holders implements podnetns.Records: the sandboxes recorded with that netns.
func (s *Sandboxes) Holders(dev, inode uint64) []podnetns.Sandbox {
	st := s.get()
	if st == nil {
		return nil
	}
	var out []podnetns.Sandbox
	for _, e := range st.Select(func(e *sandboxstate.Entry) bool {
		return e.Netns != nil && e.Netns.Dev == dev && e.Netns.Inode == inode
	}) {
		out = append(out, locatable(e))
	}
	return out
}

// Decided is what the ADD of the pod's newest recorded sandbox decided ("":
// no record says).
func (s *Sandboxes) Decided(pod *corev1.Pod) (sandboxstate.Decision, string) {
	st := s.get()
	if st == nil {
		return "", ""
	}
	var best sandboxstate.Entry
	found := false
	for _, e := range st.Select(func(e *sandboxstate.Entry) bool { return e.UID == string(pod.UID) && e.Decision != "" }) {
		if !found || e.Updated.After(best.Updated) {
			best, found = e, true
		}
	}
	return best.Decision, best.Reason
}

func locatable(e sandboxstate.Entry) podnetns.Sandbox {
	sb := podnetns.Sandbox{ID: e.ID, PodUID: e.UID}
	if n := e.Netns; n != nil {
		sb.Path, sb.Netns = n.Path, podnetns.Identity{Dev: n.Dev, Inode: n.Inode, Cookie: n.Cookie}
	}
	return sb
}
