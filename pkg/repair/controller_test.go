package repair

// Pure-logic tests of the controller's bookkeeping (once per pod, retries, Events,
// metrics) over a fake clientset; the real behaviour is proven on the test bed in
// e2e_test.go.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/record"

	"github.com/meshcni/meshcni/pkg/agent/nodepods"
	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/engine"
	"github.com/meshcni/meshcni/pkg/heal"
	"github.com/meshcni/meshcni/pkg/podnetns"
	"github.com/meshcni/meshcni/pkg/spec"
)

// fakeNetns "finds" every pod in this test's own network namespace, held open and
// named /run/netns/<pod name>; it keeps the handles to check they are closed.
type fakeNetns struct {
	err     error
	handles *[]*podnetns.Handle
	mu      *sync.Mutex
}

func newFakeNetns() fakeNetns { return fakeNetns{handles: &[]*podnetns.Handle{}, mu: &sync.Mutex{}} }

func (f fakeNetns) Locate(_ context.Context, pod *corev1.Pod) (*podnetns.Handle, error) {
	if f.err != nil {
		return nil, f.err
	}
	h, err := podnetns.Open("/proc/self/ns/net")
	if err != nil {
		return nil, err
	}
	h.Path = "/run/netns/" + pod.Name
	f.mu.Lock()
	defer f.mu.Unlock()
	*f.handles = append(*f.handles, h)
	return h, nil
}

// open is the number of handles not closed.
func (f fakeNetns) open() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, h := range *f.handles {
		if h.Fd() >= 0 {
			n++
		}
	}
	return n
}

type applies struct {
	mu    sync.Mutex
	calls []engine.Options
	specs []*spec.Spec
	// inodes are the namespaces NetnsPath led to while each apply ran (0: none).
	inodes []uint64
}

func (a *applies) apply(_ context.Context, o engine.Options, s *spec.Spec) (backend.Kind, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.calls = append(a.calls, o)
	a.specs = append(a.specs, s)
	a.inodes = append(a.inodes, inode(o.NetnsPath))
	return backend.Nftables, nil
}

func inode(path string) uint64 {
	var st unix.Stat_t
	if unix.Stat(path, &st) != nil {
		return 0
	}
	return st.Ino
}

func (a *applies) count() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.calls)
}

type harness struct {
	logs   *logRecords
	client *fake.Clientset
	events *record.FakeRecorder
	c      *Controller
	m      *Metrics
	apply  *applies
	netns  fakeNetns
	cancel func()
	done   chan struct{}
}

func start(t *testing.T, action Action, mut func(*Options, *fake.Clientset), pods ...runtime.Object) *harness {
	t.Helper()
	cs := fake.NewClientset(pods...)
	cache, err := nodepods.New(cs, node, 0)
	if err != nil {
		t.Fatal(err)
	}
	h := &harness{logs: &logRecords{}, client: cs, events: record.NewFakeRecorder(100), apply: &applies{}, netns: newFakeNetns(), done: make(chan struct{})}
	h.m, _ = NewMetrics(nil)
	o := Options{
		Policy: Policy{Node: node, Action: action, Criteria: criteria(), LabelKey: DefaultLabelKey,
			Mesh: capture.Config{ExcludeNamespaces: []string{"kube-system"}}},
		Backend: backend.Nftables, Client: cs, Events: h.events, Pods: cache,
		Netns: h.netns, Apply: h.apply.apply, Metrics: h.m, MaxAttempts: 2,
		Log: slog.New(recording{out: slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}), recs: h.logs}),
	}
	hm, _ := heal.NewMetrics(nil)
	o.Evictor = &heal.Evictor{Client: cs, Budget: heal.NewBudget(heal.Limits{}), Meshed: func() int { return 100 }, Metrics: hm, Log: o.Log}
	if mut != nil {
		mut(&o, cs) // before anything runs
	}
	if h.c, err = New(o); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	h.cancel = cancel
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); _ = cache.Run(ctx) }()
	go func() { defer wg.Done(); _ = h.c.Run(ctx) }()
	go func() { wg.Wait(); close(h.done) }()
	t.Cleanup(func() { cancel(); <-h.done })
	return h
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 5s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// nextEvent returns the next Event ("Type Reason message") or fails.
func (h *harness) nextEvent(t *testing.T) string {
	t.Helper()
	select {
	case e := <-h.events.Events:
		return e
	case <-time.After(5 * time.Second):
		t.Fatal("no Event")
		return ""
	}
}

// noEvent asserts that no Event is pending. Call it once the controller is known to
// have handled what could have caused one (judged): an Event is sent before the
// record that ends the handling.
func (h *harness) noEvent(t *testing.T) {
	t.Helper()
	select {
	case e := <-h.events.Events:
		t.Fatalf("unexpected Event %q", e)
	default:
	}
}

// judged waits for a record msg of the controller about the pod with uid whose
// attributes include want, logged after the mark since: proof that it looked.
func (h *harness) judged(t *testing.T, since int, msg, uid string, want map[string]string) {
	t.Helper()
	eventually(t, fmt.Sprintf("%q about pod %s %v", msg, uid, want), func() bool {
		return h.logs.has(since, msg, uid, want)
	})
}

// logRecords keeps the controller's log records, every level.
type logRecords struct {
	mu   sync.Mutex
	list []map[string]string // attributes, with the message as "msg"
}

// mark is the number of records so far.
func (l *logRecords) mark() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.list)
}

// has reports whether a record after the mark since has msg, uid and want.
func (l *logRecords) has(since int, msg, uid string, want map[string]string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
next:
	for _, r := range l.list[since:] {
		if r["msg"] != msg || r["pod_uid"] != uid {
			continue
		}
		for k, v := range want {
			if r[k] != v {
				continue next
			}
		}
		return true
	}
	return false
}

// recording is a slog.Handler that keeps every record and passes them to out.
type recording struct {
	out   slog.Handler
	recs  *logRecords
	attrs []slog.Attr
}

func (h recording) Enabled(context.Context, slog.Level) bool { return true }
func (h recording) WithGroup(string) slog.Handler            { return h }
func (h recording) WithAttrs(as []slog.Attr) slog.Handler {
	return recording{out: h.out.WithAttrs(as), recs: h.recs, attrs: append(append([]slog.Attr(nil), h.attrs...), as...)}
}
func (h recording) Handle(ctx context.Context, r slog.Record) error {
	m := map[string]string{"msg": r.Message}
	for _, a := range h.attrs {
		m[a.Key] = a.Value.String()
	}
	r.Attrs(func(a slog.Attr) bool { m[a.Key] = a.Value.String(); return true })
	h.recs.mu.Lock()
	h.recs.list = append(h.recs.list, m)
	h.recs.mu.Unlock()
	return h.out.Handle(ctx, r)
}

func (h *harness) count(action Action, result string) float64 {
	return testutil.ToFloat64(h.m.Repairs.WithLabelValues(string(action), result))
}

// updateStatus replaces the validation container's status through the API.
func (h *harness) updateStatus(t *testing.T, st corev1.ContainerStatus) {
	t.Helper()
	p, err := h.client.CoreV1().Pods("app").Get(context.Background(), "web", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	p.Status.InitContainerStatuses = []corev1.ContainerStatus{st}
	if _, err := h.client.CoreV1().Pods("app").UpdateStatus(context.Background(), p, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

func failedRun(id string, started time.Time) corev1.ContainerStatus {
	return corev1.ContainerStatus{Name: DefaultInitContainer, RestartCount: 2, State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{
		ExitCode: 126, ContainerID: id, StartedAt: metav1.NewTime(started), FinishedAt: metav1.NewTime(started.Add(time.Second)),
	}}}
}

func TestControllerRepairOncePerFailedRun(t *testing.T) {
	h := start(t, ActionRepair, nil, brokenPod())
	if e := h.nextEvent(t); !strings.HasPrefix(e, "Normal "+ReasonRepaired+" ") || !strings.Contains(e, "/run/netns/web") {
		t.Fatalf("Event %q", e)
	}
	if n := h.apply.count(); n != 1 {
		t.Fatalf("%d applies", n)
	}
	o, s := h.apply.calls[0], h.apply.specs[0]
	// Applied through the handle Locate returned (/proc/self/fd/N, the namespace
	// found), not through the path it was found by; the handle closed after.
	if !strings.HasPrefix(o.NetnsPath, "/proc/self/fd/") || h.apply.inodes[0] != inode("/proc/self/ns/net") || o.Backend != backend.Nftables || !s.EnableIPv4 || s.EnableIPv6 {
		t.Fatalf("apply options %+v (netns inode %d, want %d), spec v4=%v v6=%v", o, h.apply.inodes[0], inode("/proc/self/ns/net"), s.EnableIPv4, s.EnableIPv6)
	}
	if n := h.netns.open(); n != 0 {
		t.Fatalf("%d netns handles left open", n)
	}
	if h.count(ActionRepair, resultSuccess) != 1 || h.count(ActionRepair, resultError) != 0 {
		t.Fatal("metrics")
	}

	// The same failed run seen again (the kubelet reruns it, status updates): nothing.
	st := brokenPod().Status.InitContainerStatuses[0]
	st.LastTerminationState, st.State = st.State, corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}
	h.updateStatus(t, st)
	// A run that started before the repair and failed: the repair may have come too late for it.
	m := h.logs.mark()
	h.updateStatus(t, failedRun("containerd://run3", time.Now().Add(-3*time.Second)))
	h.judged(t, m, LogNothingToDo, "uid-1", map[string]string{"container_id": "containerd://run3"})
	h.noEvent(t)
	// A run started after the repair fails again: repaired again, at most MaxRepairsPerPod times.
	for i := 2; i <= MaxRepairsPerPod; i++ {
		h.updateStatus(t, failedRun(fmt.Sprintf("containerd://late%d", i), time.Now().Add(time.Duration(2*i)*time.Second)))
		if e := h.nextEvent(t); !strings.HasPrefix(e, "Normal "+ReasonRepaired) {
			t.Fatalf("Event %q", e)
		}
	}
	late := failedRun("containerd://late-last", time.Now().Add(time.Minute))
	h.updateStatus(t, late)
	if e := h.nextEvent(t); !strings.HasPrefix(e, "Warning "+ReasonGaveUp) {
		t.Fatalf("Event %q", e)
	}
	// Seen again (another status update of the same run): handled, once given up.
	late.RestartCount++
	m = h.logs.mark()
	h.updateStatus(t, late)
	h.judged(t, m, LogNothingToDo, "uid-1", map[string]string{"container_id": "containerd://late-last"})
	h.noEvent(t)
	if n := h.apply.count(); n != MaxRepairsPerPod {
		t.Fatalf("%d applies, want %d", n, MaxRepairsPerPod)
	}
}

func TestControllerRepairFailureIsReportedAndBounded(t *testing.T) {
	notFound := fmt.Errorf("pod app/web: %w: no network namespace holds 10.0.0.5", podnetns.ErrNotFound)
	h := start(t, ActionRepair, func(o *Options, _ *fake.Clientset) { o.Netns = fakeNetns{err: notFound} }, brokenPod())
	if e := h.nextEvent(t); !strings.HasPrefix(e, "Warning "+ReasonFailed+" ") || !strings.Contains(e, "network namespace not found") || !strings.Contains(e, "attempt 1 of 2") {
		t.Fatalf("Event %q", e)
	}
	if e := h.nextEvent(t); !strings.HasPrefix(e, "Warning "+ReasonGaveUp+" ") {
		t.Fatalf("Event %q", e)
	}
	// Seen again (another status update of the same run): given up, nothing more.
	st := brokenPod().Status.InitContainerStatuses[0]
	st.RestartCount++
	m := h.logs.mark()
	h.updateStatus(t, st)
	h.judged(t, m, LogNothingToDo, "uid-1", map[string]string{"container_id": st.State.Terminated.ContainerID})
	h.noEvent(t)
	if h.count(ActionRepair, resultError) != 2 || h.count(ActionRepair, resultSuccess) != 0 || h.apply.count() != 0 {
		t.Fatalf("metrics error=%v success=%v applies=%d", h.count(ActionRepair, resultError), h.count(ActionRepair, resultSuccess), h.apply.count())
	}
}

func TestControllerDeleteWaitsForPluginAndUsesPreconditions(t *testing.T) {
	var mu sync.Mutex
	ready := errors.New("entry not installed")
	pod := brokenPod()
	pod.ResourceVersion = "7"
	var pre *metav1.Preconditions
	h := start(t, ActionEvict, func(o *Options, cs *fake.Clientset) {
		o.ReadyToDelete = func() error { mu.Lock(); defer mu.Unlock(); return ready }
		cs.PrependReactor("create", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
			if a.GetSubresource() != "eviction" {
				return false, nil, nil
			}
			mu.Lock()
			defer mu.Unlock()
			ev := a.(k8stesting.CreateAction).GetObject().(*policyv1.Eviction)
			pre = ev.DeleteOptions.Preconditions
			return true, nil, cs.Tracker().Delete(corev1.SchemeGroupVersion.WithResource("pods"), ev.Namespace, ev.Name)
		})
	}, pod)
	h.judged(t, 0, LogRetryLater, "uid-1", nil) // not ready: waits
	h.noEvent(t)
	mu.Lock()
	ready = nil
	mu.Unlock()
	if e := h.nextEvent(t); !strings.HasPrefix(e, "Normal "+ReasonDeleted+" ") {
		t.Fatalf("Event %q", e)
	}
	mu.Lock()
	defer mu.Unlock()
	if pre == nil || pre.UID == nil || *pre.UID != "uid-1" || pre.ResourceVersion == nil || *pre.ResourceVersion == "" {
		t.Fatalf("preconditions %+v", pre)
	}
	if _, err := h.client.CoreV1().Pods("app").Get(context.Background(), "web", metav1.GetOptions{}); err == nil {
		t.Fatal("pod not deleted")
	}
	if h.count(ActionEvict, resultSuccess) != 1 {
		t.Fatal("metric")
	}
}

func TestControllerLabelsOnce(t *testing.T) {
	h := start(t, ActionLabel, nil, brokenPod())
	if e := h.nextEvent(t); !strings.HasPrefix(e, "Normal "+ReasonLabeled+" ") {
		t.Fatalf("Event %q", e)
	}
	eventually(t, "label", func() bool {
		p, err := h.client.CoreV1().Pods("app").Get(context.Background(), "web", metav1.GetOptions{})
		return err == nil && p.Labels[DefaultLabelKey] == LabelValue && p.Labels["app"] == "web"
	})
	m := h.logs.mark()
	h.updateStatus(t, failedRun("containerd://run9", time.Now().Add(time.Minute)))
	h.judged(t, m, LogNothingToDo, "uid-1", nil)
	h.noEvent(t)
	if h.count(ActionLabel, resultSuccess) != 1 || h.apply.count() != 0 {
		t.Fatal("metric or applies")
	}
}

func TestControllerLeavesOthersAlone(t *testing.T) {
	healthy := brokenPod()
	healthy.Name, healthy.UID = "healthy", "uid-2"
	healthy.Status.InitContainerStatuses[0].State.Terminated.ExitCode = 0
	plain := brokenPod()
	plain.Name, plain.UID, plain.Annotations = "plain", "uid-3", nil
	excluded := brokenPod()
	excluded.Namespace, excluded.UID = "kube-system", "uid-4"
	other := brokenPod()
	other.Name, other.UID = "other", "uid-5"
	other.Status.InitContainerStatuses[0].State.Terminated.ExitCode = 1
	elsewhere := brokenPod()
	elsewhere.Name, elsewhere.UID, elsewhere.Spec.NodeName = "elsewhere", "uid-6", "node-b"
	h := start(t, ActionEvict, nil, healthy, plain, excluded, other, elsewhere)
	// Each judged: not broken (the cheap test) or nothing to do (Decide).
	for _, uid := range []string{"uid-2", "uid-3", "uid-4", "uid-5", "uid-6"} {
		eventually(t, "controller judged pod "+uid, func() bool {
			return h.logs.has(0, LogNotBroken, uid, nil) || h.logs.has(0, LogNothingToDo, uid, nil)
		})
	}
	h.noEvent(t)
	l, err := h.client.CoreV1().Pods("").List(context.Background(), metav1.ListOptions{})
	if err != nil || len(l.Items) != 5 {
		t.Fatalf("pods %d, err %v", len(l.Items), err)
	}
	if h.count(ActionEvict, resultSuccess)+h.count(ActionEvict, resultError) != 0 {
		t.Fatal("metrics")
	}
}

// The once-per-UID records live only as long as their pods: dropped when a repaired
// pod is deleted, and never made for a pod the delete action removed (its informer
// delete may arrive before the action's bookkeeping).
func TestControllerForgetsDeletedPods(t *testing.T) {
	t.Run("repair", func(t *testing.T) {
		h := start(t, ActionRepair, nil, brokenPod())
		if e := h.nextEvent(t); !strings.HasPrefix(e, "Normal "+ReasonRepaired+" ") {
			t.Fatalf("Event %q", e)
		}
		if n := h.c.tracked(); n != 1 {
			t.Fatalf("%d pods tracked after the repair, want 1", n)
		}
		if err := h.client.CoreV1().Pods("app").Delete(context.Background(), "web", metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		eventually(t, "record of the deleted pod dropped", func() bool { return h.c.tracked() == 0 })
	})
	t.Run("delete", func(t *testing.T) {
		// The pod's informer delete (forget) comes before the action's bookkeeping:
		// the reactor deletes the pod and returns only once forget has run.
		var c atomic.Pointer[Controller]
		started := make(chan struct{})
		h := start(t, ActionEvict, func(_ *Options, cs *fake.Clientset) {
			cs.PrependReactor("create", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
				if a.GetSubresource() != "eviction" {
					return false, nil, nil
				}
				<-started
				ev := a.(k8stesting.CreateAction).GetObject().(*policyv1.Eviction)
				if err := cs.Tracker().Delete(corev1.SchemeGroupVersion.WithResource("pods"), ev.Namespace, ev.Name); err != nil {
					return true, nil, err
				}
				for deadline := time.Now().Add(5 * time.Second); c.Load().tracked() != 0; time.Sleep(time.Millisecond) {
					if time.Now().After(deadline) {
						return true, nil, errors.New("test: the deleted pod was not forgotten within 5s")
					}
				}
				return true, nil, nil
			})
		}, brokenPod())
		c.Store(h.c)
		close(started)
		if e := h.nextEvent(t); !strings.HasPrefix(e, "Normal "+ReasonDeleted+" ") {
			t.Fatalf("Event %q", e)
		}
		if n := h.c.tracked(); n != 0 {
			t.Fatalf("%d pods tracked after the pod was deleted, want 0", n)
		}
	})
}
