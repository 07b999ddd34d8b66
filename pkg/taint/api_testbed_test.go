package taint

// Proofs on a real kube-apiserver (the test bed's API-only mode: etcd + kube-apiserver,
// no kubelet). The tests create Node and agent Pod objects through the API and set the
// pods' status themselves, as a kubelet would.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"

	"github.com/meshcni/meshcni/internal/env/testbed"
	itestutil "github.com/meshcni/meshcni/internal/testkit/testutil"
)

// The test bed is started once for the package (API-only) and stopped by TestMain.
var bed struct {
	once sync.Once
	tb   *testbed.Testbed
	err  error
}

func TestMain(m *testing.M) {
	code := m.Run()
	if bed.tb != nil {
		if err := bed.tb.Stop(context.Background()); err != nil {
			fmt.Fprintf(os.Stderr, "stop test bed: %v\n", err)
			if code == 0 {
				code = 1
			}
		}
	}
	os.Exit(code)
}

// apiServer returns the package's API-only test bed, starting it on first use. It
// skips outside CI (fails under CI=true) without root, without the built binaries, or
// while a shared test bed (`hack/testbed up`) runs: these tests create fake Nodes,
// which must not appear in a cluster other people's tests use.
func apiServer(t testing.TB) *testbed.Testbed {
	t.Helper()
	itestutil.RequireRoot(t)
	if _, err := testbed.Lookup(); err != nil {
		if errors.Is(err, testbed.ErrNotBuilt) {
			itestutil.Missing(t, "%v", err)
		}
		t.Fatalf("testbed: %v", err)
	}
	if _, pid, ok := testbed.Running(); ok && bed.tb == nil {
		itestutil.Missing(t, "a shared test bed (pid %d) is running; these tests create fake Nodes and need their own API server", pid)
	}
	bed.once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		defer cancel()
		began := time.Now()
		bed.tb, bed.err = testbed.Start(ctx, testbed.Options{APIOnly: true, Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))})
		if bed.err == nil {
			t.Logf("API-only test bed up in %s (%s after the lock)", time.Since(began).Round(time.Millisecond), bed.tb.StartupTime.Round(time.Millisecond))
		}
	})
	if bed.err != nil {
		t.Fatalf("start API-only test bed: %v", bed.err)
	}
	return bed.tb
}

// env is one test's namespace, node label and helpers.
type env struct {
	t     testing.TB
	ctx   context.Context
	tb    *testbed.Testbed
	cs    kubernetes.Interface
	ns    string
	log   *taintLog // set by watchTaints
	label string    // nodes of this test carry meshcni.test/taint=<label> (unmanaged ones: <label>-not)
}

const testNodeLabel = "meshcni.test/taint"

// nodeNotReady is what the API server's TaintNodesByCondition admission puts on every
// node it creates.
var nodeNotReady = corev1.Taint{Key: corev1.TaintNodeNotReady, Effect: corev1.TaintEffectNoSchedule}

func newEnv(t testing.TB, ns, label string) *env {
	t.Helper()
	tb := apiServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	e := &env{t: t, ctx: ctx, tb: tb, cs: tb.Client, ns: ns, label: label}
	if err := tb.CreateNamespace(ctx, ns); err != nil && !apierrors.IsAlreadyExists(errors.Unwrap(err)) {
		t.Fatal(err)
	}
	// No controller-manager in API-only mode: the ServiceAccount admission needs the
	// namespace's default ServiceAccount before any pod.
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default", Namespace: ns}}
	if _, err := e.cs.CoreV1().ServiceAccounts(ns).Create(ctx, sa, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx := context.Background()
		_ = e.cs.CoreV1().Nodes().DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{LabelSelector: testNodeLabel + " in (" + label + "," + label + "-not)"})
		_ = e.cs.CoreV1().Namespaces().Delete(ctx, ns, metav1.DeleteOptions{})
	})
	return e
}

func (e *env) config(identity string) *Config {
	return &Config{
		AgentNamespace: e.ns,
		AgentSelector:  labels.SelectorFromSet(labels.Set{"app.kubernetes.io/name": "meshcni", "app.kubernetes.io/component": "agent"}),
		NodeSelector:   labels.SelectorFromSet(labels.Set{testNodeLabel: e.label}),
		TaintNewNodes:  true,
		GracePeriod:    2 * time.Second,
		// The tests before the breaker's prove the taint's life cycle on any node.
		TaintMode:          Always,
		MaxTaintedFraction: 1,
		Workers:            2,
		LeaderElect:        true,
		LeaseName:          "meshcni-taint-" + e.label,
		LeaseNamespace:     e.ns,
		Identity:           identity,
		LeaseDuration:      2 * time.Second,
		RenewDeadline:      time.Second,
		RetryPeriod:        500 * time.Millisecond,
		KeepLeaseOnExit:    false,
	}
}

// replica is a running controller with its own API client, whose node writes are
// counted at the HTTP level.
type replica struct {
	c          *Controller
	id         string
	logs       *records
	nodeWrites atomic.Int64 // PATCH/PUT on nodes sent by this replica
	cancel     context.CancelFunc
	done       chan error
}

type countingRT struct {
	rt http.RoundTripper
	n  *atomic.Int64
}

func (c countingRT) RoundTrip(r *http.Request) (*http.Response, error) {
	if (r.Method == http.MethodPatch || r.Method == http.MethodPut) && strings.HasPrefix(r.URL.Path, "/api/v1/nodes/") {
		c.n.Add(1)
	}
	return c.rt.RoundTrip(r)
}

func (e *env) start(cfg *Config) *replica {
	e.t.Helper()
	r := &replica{id: cfg.Identity, done: make(chan error, 1)}
	rc := rest.CopyConfig(e.tb.RESTConfig)
	rc.UserAgent = Component + "/" + cfg.Identity
	rc.Wrap(func(rt http.RoundTripper) http.RoundTripper { return countingRT{rt: rt, n: &r.nodeWrites} })
	cs, err := kubernetes.NewForConfig(rc)
	if err != nil {
		e.t.Fatal(err)
	}
	r.logs = &records{}
	log := slog.New(recorder{out: slog.NewTextHandler(testWriter{e.t}, &slog.HandlerOptions{Level: slog.LevelInfo}), recs: r.logs}).With("replica", cfg.Identity)
	r.c, err = New(cs, cfg, log)
	if err != nil {
		e.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(e.ctx)
	r.cancel = cancel
	go func() { r.done <- r.c.Run(ctx) }()
	e.t.Cleanup(func() { r.stop(e.t) })
	return r
}

// stop cancels the replica's context and waits for Run to return.
func (r *replica) stop(t testing.TB) {
	if r.cancel == nil {
		return
	}
	r.cancel()
	r.cancel = nil
	select {
	case err := <-r.done:
		if err != nil {
			t.Errorf("replica %s: Run: %v", r.id, err)
		}
	case <-time.After(10 * time.Second):
		t.Errorf("replica %s: Run did not return 10s after its context ended", r.id)
	}
}

func (r *replica) leading() bool { return testutil.ToFloat64(r.c.Metrics.Leader) == 1 }
func (r *replica) changes(a Action) int {
	return int(testutil.ToFloat64(r.c.Metrics.Changes.WithLabelValues(a.String())))
}

type testWriter struct{ t testing.TB }

// logRecord is one log record of a replica, its attributes as strings.
type logRecord struct {
	at    time.Time
	msg   string
	attrs map[string]string
}

// records keeps a replica's log records, every level.
type records struct {
	mu   sync.Mutex
	list []logRecord
}

// find returns the records with msg whose attributes include every one of want.
func (rs *records) find(msg string, want map[string]string) []logRecord {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	var out []logRecord
next:
	for _, r := range rs.list {
		if r.msg != msg {
			continue
		}
		for k, v := range want {
			if r.attrs[k] != v {
				continue next
			}
		}
		out = append(out, r)
	}
	return out
}

// recorder is a slog.Handler that records every record and passes those its out
// handler takes on.
type recorder struct {
	out   slog.Handler
	recs  *records
	attrs []slog.Attr
}

func (h recorder) Enabled(context.Context, slog.Level) bool { return true }
func (h recorder) WithGroup(string) slog.Handler            { return h }
func (h recorder) WithAttrs(as []slog.Attr) slog.Handler {
	return recorder{out: h.out.WithAttrs(as), recs: h.recs, attrs: append(append([]slog.Attr(nil), h.attrs...), as...)}
}
func (h recorder) Handle(ctx context.Context, r slog.Record) error {
	rec := logRecord{at: r.Time, msg: r.Message, attrs: map[string]string{}}
	for _, a := range h.attrs {
		rec.attrs[a.Key] = a.Value.String()
	}
	r.Attrs(func(a slog.Attr) bool { rec.attrs[a.Key] = a.Value.String(); return true })
	h.recs.mu.Lock()
	h.recs.list = append(h.recs.list, rec)
	h.recs.mu.Unlock()
	if h.out.Enabled(ctx, r.Level) {
		return h.out.Handle(ctx, r)
	}
	return nil
}

// decided waits until the replica has decided about the node with its agent pods as
// agents ("namespace/name ready=…", comma-separated, in any order: "" for none), at or
// after since, and returns that decision ("add", "remove" or "none"). It proves the
// controller looked at the node in that state; only then does "it did nothing" mean
// anything.
func (e *env) decided(r *replica, node, agents string, since time.Time) string {
	e.t.Helper()
	var action string
	e.eventually(10*time.Second, fmt.Sprintf("%s decides about %s with agent pods [%s]", r.id, node, agents), func() bool {
		for _, rec := range r.logs.find(LogDecided, map[string]string{"node": node}) {
			if !rec.at.Before(since) && sameSet(rec.attrs["agent_pods"], agents) {
				action = rec.attrs["action"]
				return true
			}
		}
		return false
	})
	return action
}

func sameSet(a, b string) bool {
	split := func(s string) []string {
		if s == "" {
			return nil
		}
		l := strings.Split(s, ", ")
		slices.Sort(l)
		return l
	}
	return slices.Equal(split(a), split(b))
}

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

func (e *env) createNode(name string, taints ...corev1.Taint) {
	e.t.Helper()
	n := &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{testNodeLabel: e.label}},
		Spec:       corev1.NodeSpec{Taints: taints},
	}
	if _, err := e.cs.CoreV1().Nodes().Create(e.ctx, n, metav1.CreateOptions{}); err != nil {
		e.t.Fatal(err)
	}
}

func (e *env) node(name string) *corev1.Node {
	e.t.Helper()
	n, err := e.cs.CoreV1().Nodes().Get(e.ctx, name, metav1.GetOptions{})
	if err != nil {
		e.t.Fatal(err)
	}
	return n
}

// createAgent creates an agent pod bound to node, Ready or not (status set through
// UpdateStatus, as the kubelet would).
func (e *env) createAgent(name, node string, ready bool) {
	e.t.Helper()
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: e.ns,
			Labels: map[string]string{"app.kubernetes.io/name": "meshcni", "app.kubernetes.io/component": "agent"}},
		Spec: corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "agent", Image: "meshcni.local/agent:test"}}},
	}
	if _, err := e.cs.CoreV1().Pods(e.ns).Create(e.ctx, p, metav1.CreateOptions{}); err != nil {
		e.t.Fatal(err)
	}
	e.setReady(name, ready)
}

func (e *env) setReady(name string, ready bool) {
	e.t.Helper()
	p, err := e.cs.CoreV1().Pods(e.ns).Get(e.ctx, name, metav1.GetOptions{})
	if err != nil {
		e.t.Fatal(err)
	}
	st := corev1.ConditionFalse
	if ready {
		st = corev1.ConditionTrue
	}
	now := metav1.Now()
	p.Status.Phase = corev1.PodRunning
	p.Status.Conditions = []corev1.PodCondition{
		{Type: corev1.PodScheduled, Status: corev1.ConditionTrue, LastTransitionTime: now},
		{Type: corev1.ContainersReady, Status: st, LastTransitionTime: now},
		{Type: corev1.PodReady, Status: st, LastTransitionTime: now},
	}
	if _, err := e.cs.CoreV1().Pods(e.ns).UpdateStatus(e.ctx, p, metav1.UpdateOptions{}); err != nil {
		e.t.Fatal(err)
	}
}

// deleteAgent deletes an agent pod: at once (force), or gracefully, which without a
// kubelet leaves it Terminating (deletionTimestamp set) until a force delete.
func (e *env) deleteAgent(name string, force bool) {
	e.t.Helper()
	opts := metav1.DeleteOptions{}
	if force {
		zero := int64(0)
		opts.GracePeriodSeconds = &zero
	}
	if err := e.cs.CoreV1().Pods(e.ns).Delete(e.ctx, name, opts); err != nil {
		e.t.Fatal(err)
	}
}

// waitTaint waits until the node's taint is as wanted, in the API and in the test's
// watch (if any), and returns how long that took.
func (e *env) waitTaint(name string, want bool, within time.Duration) time.Duration {
	e.t.Helper()
	began := time.Now()
	for {
		if HasTaint(e.node(name)) == want && (e.log == nil || e.log.state(name) == want) {
			return time.Since(began)
		}
		if time.Since(began) > within {
			e.t.Fatalf("node %s: taint present=%v not reached within %s (taints %v)", name, want, within, e.node(name).Spec.Taints)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// renewals polls the Lease until its renewTime has changed n times, calling check at
// every poll.
func (e *env) renewals(lease string, n int, check func()) {
	e.t.Helper()
	var last time.Time
	seen := -1
	e.eventually(time.Duration(n)*10*time.Second, fmt.Sprintf("%d renewals of the Lease", n), func() bool {
		check()
		l, err := e.cs.CoordinationV1().Leases(e.ns).Get(e.ctx, lease, metav1.GetOptions{})
		if err != nil {
			e.t.Fatal(err)
		}
		if rt := l.Spec.RenewTime; rt != nil && !rt.Time.Equal(last) {
			last, seen = rt.Time, seen+1
		}
		return seen >= n
	})
}

// eventually polls cond every 20 ms for up to within.
func (e *env) eventually(within time.Duration, what string, cond func() bool) time.Duration {
	e.t.Helper()
	began := time.Now()
	for !cond() {
		if time.Since(began) > within {
			e.t.Fatalf("not within %s: %s", within, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return time.Since(began)
}

// eventMessages returns the messages of the controller's Events with reason on the node.
func (e *env) eventMessages(node, reason string) []string {
	e.t.Helper()
	l, err := e.cs.CoreV1().Events("default").List(e.ctx, metav1.ListOptions{
		FieldSelector: "involvedObject.kind=Node,involvedObject.name=" + node + ",reason=" + reason})
	if err != nil {
		e.t.Fatal(err)
	}
	var out []string
	for _, ev := range l.Items {
		if ev.Source.Component == Component {
			out = append(out, ev.Message)
		}
	}
	return out
}

// events returns the count of Events with reason on the node (Events of nodes land in
// the default namespace), summing aggregated counts.
func (e *env) events(node, reason string) int {
	e.t.Helper()
	l, err := e.cs.CoreV1().Events("default").List(e.ctx, metav1.ListOptions{
		FieldSelector: "involvedObject.kind=Node,involvedObject.name=" + node + ",reason=" + reason})
	if err != nil {
		e.t.Fatal(err)
	}
	n := 0
	for _, ev := range l.Items {
		if ev.Source.Component != Component {
			continue
		}
		if ev.Count > 0 {
			n += int(ev.Count)
		} else {
			n++
		}
	}
	return n
}

// flip is a change of the taint's presence on a node, as a watch saw it.
type flip struct {
	at      time.Time
	node    string
	tainted bool
}

// taintLog records, from an independent watch of the test's nodes, every change of
// the taint's presence (the first sight of a node is not a change).
type taintLog struct {
	mu    sync.Mutex
	last  map[string]bool
	flips []flip
}

func (e *env) watchTaints() *taintLog {
	e.t.Helper()
	l := &taintLog{last: map[string]bool{}}
	f := informers.NewSharedInformerFactoryWithOptions(e.cs, 0, informers.WithTweakListOptions(func(o *metav1.ListOptions) {
		o.LabelSelector = testNodeLabel + "=" + e.label
	}))
	inf := f.Core().V1().Nodes().Informer()
	see := func(obj any) {
		n, ok := obj.(*corev1.Node)
		if !ok {
			return
		}
		l.mu.Lock()
		defer l.mu.Unlock()
		tainted := HasTaint(n)
		if was, seen := l.last[n.Name]; seen && was != tainted {
			l.flips = append(l.flips, flip{at: time.Now(), node: n.Name, tainted: tainted})
		}
		l.last[n.Name] = tainted
	}
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: see, UpdateFunc: func(_, n any) { see(n) }}); err != nil {
		e.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(e.ctx)
	f.Start(ctx.Done())
	e.t.Cleanup(func() { cancel(); f.Shutdown() })
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
		e.t.Fatal("taint watch not synced")
	}
	e.log = l
	return l
}

// state is the taint's presence on node as the watch last saw it.
func (l *taintLog) state(node string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.last[node]
}

// of returns the flips of one node (all nodes: "").
func (l *taintLog) of(node string) []flip {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []flip
	for _, f := range l.flips {
		if node == "" || f.node == node {
			out = append(out, f)
		}
	}
	return out
}

// TestTaintLifecycle: one controller (leader-elected on a real Lease) against nodes
// and agent pods created through the API.
func TestTaintLifecycle(t *testing.T) {
	e := newEnv(t, "meshcni-taint-life", "life")
	log := e.watchTaints()
	cfg := e.config("solo")
	grace := cfg.GracePeriod
	r := e.start(cfg)
	e.eventually(5*time.Second, "solo leads", r.leading)

	t.Run("a new node gets the taint at once", func(t *testing.T) {
		e.t = t
		e.createNode("life-new")
		took := e.waitTaint("life-new", true, 10*time.Second)
		t.Logf("new node tainted %s after creation", took.Round(time.Millisecond))
		e.eventually(5*time.Second, "TaintAdded event", func() bool { return e.events("life-new", ReasonTaintAdded) == 1 })
		// At once by the new-node rule, not after the grace period (BenchmarkTaint
		// measures how soon).
		if m := e.eventMessages("life-new", ReasonTaintAdded); len(m) != 1 || !strings.HasSuffix(m[0], ": new node, no meshcni agent pod") {
			t.Errorf("TaintAdded Event %q, want the new-node rule's", m)
		}
	})

	t.Run("the taint goes when the agent pod turns Ready", func(t *testing.T) {
		e.t = t
		created := time.Now()
		e.createAgent("agent-life-new", "life-new", false)
		// A not-Ready agent pod keeps the taint.
		if a := e.decided(r, "life-new", e.ns+"/agent-life-new ready=false", created); a != "none" {
			t.Fatalf("decided %q with the agent pod not Ready, want none", a)
		}
		if !HasTaint(e.node("life-new")) || len(log.of("life-new")) != 1 {
			t.Fatalf("taint changed while the agent pod is not Ready: %+v", log.of("life-new"))
		}
		began := time.Now()
		e.setReady("agent-life-new", true)
		e.waitTaint("life-new", false, 5*time.Second)
		t.Logf("taint removed %s after the agent pod turned Ready", time.Since(began).Round(time.Millisecond))
		e.eventually(5*time.Second, "TaintRemoved event", func() bool { return e.events("life-new", ReasonTaintRemoved) == 1 })
	})

	t.Run("the taint comes back only after the grace period when the agent pod is deleted", func(t *testing.T) {
		e.t = t
		before := len(log.of("life-new"))
		deleted := time.Now()
		e.deleteAgent("agent-life-new", true)
		e.waitTaint("life-new", true, grace+10*time.Second)
		// The watch saw every change: one, the taint, no sooner than the grace period.
		fs := log.of("life-new")[before:]
		if len(fs) != 1 || !fs[0].tainted {
			t.Fatalf("changes after the agent pod was deleted: %+v, want one taint", fs)
		}
		after := fs[0].at.Sub(deleted)
		t.Logf("tainted %s after the agent pod was deleted (grace %s)", after.Round(time.Millisecond), grace)
		if after < grace {
			t.Errorf("tainted %s after the agent pod was deleted, before the grace period %s", after, grace)
		}
		e.eventually(5*time.Second, "a TaintAdded Event by the grace rule", func() bool {
			for _, m := range e.eventMessages("life-new", ReasonTaintAdded) {
				if strings.Contains(m, "(grace period "+grace.String()+")") {
					return true
				}
			}
			return false
		})
		// Agent lost while still Ready-looking (Terminating) counts as not Ready too:
		// back to Ready, then graceful delete.
		e.createAgent("agent-life-new-2", "life-new", true)
		e.waitTaint("life-new", false, 5*time.Second)
		e.deleteAgent("agent-life-new-2", false)
		e.waitTaint("life-new", true, grace+2*time.Second)
		e.deleteAgent("agent-life-new-2", true)
	})

	t.Run("a node that starts tainted keeps its other taints", func(t *testing.T) {
		e.t = t
		cloud := corev1.Taint{Key: "node.cloudprovider.kubernetes.io/uninitialized", Value: "true", Effect: corev1.TaintEffectNoSchedule}
		ourKeyExec := corev1.Taint{Key: TaintKey, Effect: corev1.TaintEffectNoExecute} // same key, other effect: not ours
		custom := corev1.Taint{Key: "example.com/maintenance", Value: "x", Effect: corev1.TaintEffectPreferNoSchedule}
		e.createNode("life-startup", cloud, Taint(), ourKeyExec, custom)
		// The API server's TaintNodesByCondition admission adds node.kubernetes.io/not-ready
		// to every new node: one more taint that must stay.
		created := time.Now()
		e.createAgent("agent-life-startup", "life-startup", false)
		if a := e.decided(r, "life-startup", e.ns+"/agent-life-startup ready=false", created); a != "none" {
			t.Fatalf("decided %q with the agent pod not Ready, want none", a)
		}
		if got := e.node("life-startup").Spec.Taints; !reflect.DeepEqual(got, []corev1.Taint{cloud, Taint(), ourKeyExec, custom, nodeNotReady}) {
			t.Fatalf("taints changed while the agent is not Ready: %v", got)
		}
		e.setReady("agent-life-startup", true)
		e.waitTaint("life-startup", false, 5*time.Second)
		if got := e.node("life-startup").Spec.Taints; !reflect.DeepEqual(got, []corev1.Taint{cloud, ourKeyExec, custom, nodeNotReady}) {
			t.Fatalf("taints after removal %v, want the others intact and in order", got)
		}
	})

	t.Run("a rolled-over agent never taints its node", func(t *testing.T) {
		e.t = t
		e.createNode("life-roll")
		e.waitTaint("life-roll", true, 10*time.Second)
		e.createAgent("agent-roll-old", "life-roll", true)
		e.waitTaint("life-roll", false, 5*time.Second)
		before := len(log.of("life-roll"))
		// DaemonSet rolling update: the old pod terminates, the new one is created and
		// becomes Ready within the grace period, then the old one is gone.
		e.deleteAgent("agent-roll-old", false)
		time.Sleep(300 * time.Millisecond)
		e.createAgent("agent-roll-new", "life-roll", false)
		time.Sleep(700 * time.Millisecond)
		e.setReady("agent-roll-new", true)
		e.deleteAgent("agent-roll-old", true)
		// And a second kind of roll: the pod deleted at once, its successor Ready 1.5 s later.
		time.Sleep(200 * time.Millisecond)
		lost := time.Now()
		e.deleteAgent("agent-roll-new", true)
		time.Sleep(grace * 3 / 4)
		e.createAgent("agent-roll-newer", "life-roll", true)
		// The controller looks again when the grace of the last loss ends: it finds
		// the successor Ready and does nothing.
		if a := e.decided(r, "life-roll", e.ns+"/agent-roll-newer ready=true", lost.Add(grace)); a != "none" {
			t.Fatalf("decided %q after the grace with the successor Ready, want none", a)
		}
		if fs := log.of("life-roll")[before:]; len(fs) > 0 {
			t.Fatalf("the node's taint changed during the rollovers: %+v", fs)
		}
		if HasTaint(e.node("life-roll")) {
			t.Fatal("tainted after the rollovers")
		}
	})

	t.Run("a node outside --node-selector is never touched", func(t *testing.T) {
		e.t = t
		n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "life-unmanaged", Labels: map[string]string{testNodeLabel: e.label + "-not"}}}
		if _, err := e.cs.CoreV1().Nodes().Create(e.ctx, n, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		// A change of a managed node after it: once the controller has decided about
		// that, its node watch (ordered by resourceVersion) is past the unmanaged
		// node's creation, and its cache, which every decision reads, lacks it.
		poked, err := e.cs.CoreV1().Nodes().Patch(e.ctx, "life-roll", types.MergePatchType, []byte(`{"metadata":{"labels":{"meshcni.test/poke":"1"}}}`), metav1.PatchOptions{})
		if err != nil {
			t.Fatal(err)
		}
		e.eventually(10*time.Second, "a decision about life-roll at its poked resourceVersion", func() bool {
			return len(r.logs.find(LogDecided, map[string]string{"node": "life-roll", "resource_version": poked.ResourceVersion})) > 0
		})
		if _, err := r.c.nodes.Get("life-unmanaged"); !apierrors.IsNotFound(err) {
			t.Fatalf("the controller's cache holds the unmanaged node: %v", err)
		}
		if got := e.node("life-unmanaged").Spec.Taints; !reflect.DeepEqual(got, []corev1.Taint{nodeNotReady}) {
			t.Fatalf("unmanaged node's taints %v, want only the API server's", got)
		}
		if len(r.logs.find(LogDecided, map[string]string{"node": "life-unmanaged"})) > 0 {
			t.Fatal("the controller decided about the unmanaged node")
		}
	})

	t.Run("a stale base never drops a taint written meanwhile", func(t *testing.T) {
		e.t = t
		// On the unmanaged node, so that the running controller stays out of it.
		stale := e.node("life-unmanaged")
		other := corev1.Taint{Key: "example.com/added-meanwhile", Effect: corev1.TaintEffectNoSchedule}
		fresh := stale.DeepCopy()
		fresh.Spec.Taints = append(fresh.Spec.Taints, other)
		if _, err := e.cs.CoreV1().Nodes().Update(e.ctx, fresh, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		// setTaint from the stale copy: the patch carries its resourceVersion, the API
		// server answers Conflict, the retry reads the node again.
		changed, err := setTaint(e.ctx, e.cs, stale, true)
		if err != nil || !changed {
			t.Fatalf("add: changed %v, %v", changed, err)
		}
		if got := e.node("life-unmanaged").Spec.Taints; !reflect.DeepEqual(got, []corev1.Taint{nodeNotReady, other, Taint()}) {
			t.Fatalf("taints %v, want the one added meanwhile kept", got)
		}
		// Removal from the same stale copy (which has neither taint).
		stale.Spec.Taints = append(stale.Spec.Taints, Taint())
		changed, err = setTaint(e.ctx, e.cs, stale, false)
		if err != nil || !changed {
			t.Fatalf("remove: changed %v, %v", changed, err)
		}
		if got := e.node("life-unmanaged").Spec.Taints; !reflect.DeepEqual(got, []corev1.Taint{nodeNotReady, other}) {
			t.Fatalf("taints %v, want only ours removed", got)
		}
		// Nothing to do: no write.
		if changed, err := setTaint(e.ctx, e.cs, e.node("life-unmanaged"), false); err != nil || changed {
			t.Fatalf("no-op: changed %v, %v", changed, err)
		}
	})

	t.Run("metrics and health", func(t *testing.T) {
		e.t = t
		srv := httptest.NewServer(r.c.Handler())
		defer srv.Close()
		for _, p := range []string{"/healthz", "/readyz"} {
			if code, body := get(t, srv.URL+p); code != http.StatusOK {
				t.Errorf("%s: %d %s", p, code, body)
			}
		}
		_, body := get(t, srv.URL+"/metrics")
		// life-new is tainted (its agent was deleted), life-startup and life-roll are not.
		adds, removes := 0, 0
		for _, f := range log.of("") {
			if f.tainted {
				adds++
			} else {
				removes++
			}
		}
		for _, want := range []string{
			"meshcni_taint_nodes_tainted 1\n",
			"meshcni_taint_leader 1\n",
			fmt.Sprintf("meshcni_taint_changes_total{action=\"add\"} %d\n", adds),
			fmt.Sprintf("meshcni_taint_changes_total{action=\"remove\"} %d\n", removes),
		} {
			if !strings.Contains(body, want) {
				t.Errorf("/metrics lacks %q", want)
			}
		}
		if int(r.nodeWrites.Load()) != adds+removes {
			t.Errorf("node writes %d, want exactly one per change (%d)", r.nodeWrites.Load(), adds+removes)
		}
	})
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(b)
}

// TestTwoReplicas: two controllers with different identities on one real Lease. Exactly
// one leads; only it writes (counted at the HTTP level and as Events); the taints
// converge and stay. Killing the leader without releasing the Lease (a crash) hands over
// within the lease duration; a graceful stop releases it at once.
func TestTwoReplicas(t *testing.T) {
	e := newEnv(t, "meshcni-taint-ha", "ha")
	log := e.watchTaints()
	cfgA := e.config("replica-a")
	cfgA.KeepLeaseOnExit = true // its stop is a crash: the Lease is not released
	a := e.start(cfgA)
	e.eventually(5*time.Second, "replica-a leads", a.leading)
	b := e.start(e.config("replica-b"))
	lease := func() string {
		l, err := e.cs.CoordinationV1().Leases(e.ns).Get(e.ctx, cfgA.LeaseName, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if l.Spec.HolderIdentity == nil {
			return ""
		}
		return *l.Spec.HolderIdentity
	}
	e.eventually(5*time.Second, "replica-b's caches synced", func() bool { return b.c.Ready() == nil })

	// Exactly one leader at every sample while replica-b has seen replica-a lead and
	// replica-a has renewed the Lease 6 times, and the Lease names it.
	e.renewals(cfgA.LeaseName, 6, func() {
		if !a.leading() || b.leading() {
			t.Fatalf("leading: a=%v b=%v, want a only", a.leading(), b.leading())
		}
	})
	e.eventually(10*time.Second, "replica-b observes replica-a leading", func() bool {
		return len(b.logs.find("leader observed", map[string]string{"leader": "replica-a"})) > 0
	})
	if !a.leading() || b.leading() {
		t.Fatalf("leading: a=%v b=%v, want a only", a.leading(), b.leading())
	}
	if h := lease(); h != "replica-a" {
		t.Fatalf("Lease holder %q, want replica-a", h)
	}

	// Drive three nodes: created (tainted at once), two agents Ready (untainted), one
	// agent lost (tainted after the grace), one agent never Ready.
	for _, n := range []string{"ha-1", "ha-2", "ha-3"} {
		e.createNode(n)
		e.waitTaint(n, true, 10*time.Second)
	}
	e.createAgent("agent-ha-1", "ha-1", true)
	e.createAgent("agent-ha-2", "ha-2", true)
	e.createAgent("agent-ha-3", "ha-3", false)
	e.waitTaint("ha-1", false, 5*time.Second)
	e.waitTaint("ha-2", false, 5*time.Second)
	e.deleteAgent("agent-ha-2", true)
	e.waitTaint("ha-2", true, cfgA.GracePeriod+10*time.Second)
	// Converged: it stays so (no fight, no flapping) over several renewals.
	e.renewals(cfgA.LeaseName, 4, func() {})
	want := map[string]bool{"ha-1": false, "ha-2": true, "ha-3": true}
	for n, tainted := range want {
		if HasTaint(e.node(n)) != tainted {
			t.Errorf("node %s tainted=%v, want %v", n, !tainted, tainted)
		}
	}
	flips := log.of("")
	if len(flips) != 6 { // 3 new-node adds, 2 removes, 1 add after the grace
		t.Fatalf("taint changed %d times, want 6: %+v", len(flips), flips)
	}
	if a.changes(Add) != 4 || a.changes(Remove) != 2 || a.nodeWrites.Load() != 6 {
		t.Errorf("leader: %d adds, %d removes, %d node writes; want 4, 2, 6", a.changes(Add), a.changes(Remove), a.nodeWrites.Load())
	}
	if b.changes(Add)+b.changes(Remove) != 0 || b.nodeWrites.Load() != 0 {
		t.Errorf("follower wrote: %d changes, %d node writes; want none", b.changes(Add)+b.changes(Remove), b.nodeWrites.Load())
	}
	wantEvents := map[string][2]int{"ha-1": {1, 1}, "ha-2": {2, 1}, "ha-3": {1, 0}}
	e.eventually(5*time.Second, "one Event per change", func() bool {
		for n, w := range wantEvents {
			if e.events(n, ReasonTaintAdded) != w[0] || e.events(n, ReasonTaintRemoved) != w[1] {
				return false
			}
		}
		return true
	})
	if !a.leading() || b.leading() {
		t.Errorf("leader gauges: a=%v b=%v, want a only", a.leading(), b.leading())
	}

	// Crash the leader: the follower takes over once the Lease expires, not before.
	killed := time.Now()
	a.stop(t)
	l, err := e.cs.CoordinationV1().Leases(e.ns).Get(e.ctx, cfgA.LeaseName, metav1.GetOptions{})
	if err != nil || l.Spec.RenewTime == nil || *l.Spec.HolderIdentity != "replica-a" {
		t.Fatalf("Lease after replica-a died: %+v, %v", l, err)
	}
	lastRenew := l.Spec.RenewTime.Time
	e.eventually(30*time.Second, "replica-b takes over", b.leading)
	l, err = e.cs.CoordinationV1().Leases(e.ns).Get(e.ctx, cfgA.LeaseName, metav1.GetOptions{})
	if err != nil || l.Spec.AcquireTime == nil || *l.Spec.HolderIdentity != "replica-b" {
		t.Fatalf("Lease after the takeover: %+v, %v", l, err)
	}
	gap := l.Spec.AcquireTime.Sub(lastRenew)
	t.Logf("replica-b leads %s after replica-a died without releasing the Lease, %s after its last renewal (lease duration %s, retry period %s)",
		time.Since(killed).Round(time.Millisecond), gap.Round(time.Millisecond), cfgA.LeaseDuration, cfgA.RetryPeriod)
	// client-go: a candidate takes over once it has seen no renewal for a lease
	// duration. It tells renewals apart by the record's JSON, whose times are whole
	// seconds (metav1.Time): a renewal in the same second as the one it saw before is
	// not seen, so the takeover may come up to 1 s before a lease duration has passed,
	// never sooner. (How late it comes depends on the retry period and the machine.)
	if low := cfgA.LeaseDuration - time.Second; gap < low {
		t.Errorf("takeover %s after the last renewal, want no sooner than %s", gap, low)
	}
	// The new leader re-reads every node and finds nothing to change.
	for n, agents := range map[string]string{"ha-1": e.ns + "/agent-ha-1 ready=true", "ha-2": "", "ha-3": e.ns + "/agent-ha-3 ready=false"} {
		if a := e.decided(b, n, agents, killed); a != "none" {
			t.Errorf("replica-b decided %q about %s after the takeover, want none", a, n)
		}
	}
	if n := len(log.of("")); n != 6 || b.nodeWrites.Load() != 0 {
		t.Fatalf("the takeover changed taints: %d changes, %d writes by replica-b", n-6, b.nodeWrites.Load())
	}
	// It acts on changes: ha-3's agent turns Ready.
	e.setReady("agent-ha-3", true)
	e.waitTaint("ha-3", false, 5*time.Second)
	if b.changes(Remove) != 1 || b.nodeWrites.Load() != 1 || a.nodeWrites.Load() != 6 {
		t.Errorf("after takeover: replica-b %d removes, %d writes; replica-a %d writes", b.changes(Remove), b.nodeWrites.Load(), a.nodeWrites.Load())
	}

	// A graceful stop releases the Lease: a standby takes over within a retry period.
	c := e.start(e.config("replica-c"))
	e.eventually(5*time.Second, "replica-c's caches synced", func() bool { return c.c.Ready() == nil })
	e.eventually(10*time.Second, "replica-c observes replica-b leading", func() bool {
		return len(c.logs.find("leader observed", map[string]string{"leader": "replica-b"})) > 0
	})
	if c.leading() {
		t.Fatal("replica-c leads while replica-b holds the Lease")
	}
	stopped := time.Now()
	b.stop(t)
	// Released: no holder, so replica-c need not wait for it to expire.
	if h := lease(); h != "" && h != "replica-c" {
		t.Fatalf("Lease holder %q after replica-b stopped, want it released", h)
	}
	e.eventually(30*time.Second, "replica-c takes over", c.leading)
	t.Logf("replica-c leads %s after replica-b stopped and released the Lease", time.Since(stopped).Round(time.Millisecond))
	if h := lease(); h != "replica-c" {
		t.Errorf("Lease holder %q, want replica-c", h)
	}
	e.deleteAgent("agent-ha-1", true)
	e.waitTaint("ha-1", true, cfgA.GracePeriod+10*time.Second)
	if c.nodeWrites.Load() != 1 || len(log.of("")) != 8 {
		t.Errorf("replica-c: %d writes, %d changes in all; want 1 and 8", c.nodeWrites.Load(), len(log.of("")))
	}
}

// BenchmarkTaint measures how soon one leader acts, against the API-only test bed.
// Per iteration a node is created (tainted by the new-node rule), gets a Ready agent
// pod (untainted), and loses it (tainted again once the 2 s grace period is over); the
// times are those of the changes as an independent watch saw them. Reported
// (medians): new-node-ms, from the node's creation to the taint; ready-ms, from the
// agent pod's Ready status to the taint's removal; grace-overrun-ms, from the end of
// the grace period to the taint.
func BenchmarkTaint(b *testing.B) {
	e := newEnv(b, "meshcni-taint-bench", "bench")
	log := e.watchTaints()
	cfg := e.config("bench")
	r := e.start(cfg)
	e.eventually(10*time.Second, "bench leads", r.leading)
	var newNode, ready, overrun []time.Duration
	// flipAfter waits for the node's next taint change and returns its time.
	flipAfter := func(node string, n int, tainted bool) time.Time {
		e.waitTaint(node, tainted, cfg.GracePeriod+10*time.Second)
		fs := log.of(node)
		if len(fs) != n+1 || fs[n].tainted != tainted {
			b.Fatalf("node %s: changes %+v, want change %d to tainted=%v", node, fs, n+1, tainted)
		}
		return fs[n].at
	}
	for i := 0; b.Loop(); i++ {
		node, agent := fmt.Sprintf("bench-%d", i), fmt.Sprintf("agent-bench-%d", i)
		began := time.Now()
		e.createNode(node)
		newNode = append(newNode, flipAfter(node, 0, true).Sub(began))
		e.createAgent(agent, node, false)
		began = time.Now()
		e.setReady(agent, true)
		ready = append(ready, flipAfter(node, 1, false).Sub(began))
		began = time.Now()
		e.deleteAgent(agent, true)
		overrun = append(overrun, flipAfter(node, 2, true).Sub(began)-cfg.GracePeriod)
	}
	for _, m := range []struct {
		ds   []time.Duration
		unit string
	}{{newNode, "new-node-ms"}, {ready, "ready-ms"}, {overrun, "grace-overrun-ms"}} {
		slices.Sort(m.ds)
		b.ReportMetric(float64(m.ds[len(m.ds)/2].Microseconds())/1000, m.unit)
	}
}
