package taint

// The breaker and --taint-mode=joining on the real kube-apiserver (the test bed's
// API-only mode), with the settings the chart ships: joining mode, at most 10 % of the
// managed nodes tainted, never fewer than 1.

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// breakerConfig is e.config with the chart's defaults of the mode and the limit.
func (e *env) breakerConfig(identity string) *Config {
	cfg := e.config(identity)
	cfg.TaintMode, cfg.MaxTaintedFraction, cfg.MaxTaintedFloor = Joining, 0.1, 1
	return cfg
}

// maxTainted replays the watch's changes of the nodes (all untainted when first seen)
// and returns the most that carried the taint at once.
func maxTainted(l *taintLog) int {
	on := map[string]bool{}
	most := 0
	for _, f := range l.of("") {
		on[f.node] = f.tainted
		n := 0
		for _, t := range on {
			if t {
				n++
			}
		}
		most = max(most, n)
	}
	return most
}

// clusterEvents counts the controller's Events with reason on the nodes whose names
// start with prefix.
func (e *env) clusterEvents(prefix, reason string) int {
	e.t.Helper()
	l, err := e.cs.CoreV1().Events("default").List(e.ctx, metav1.ListOptions{FieldSelector: "involvedObject.kind=Node,reason=" + reason})
	if err != nil {
		e.t.Fatal(err)
	}
	n := 0
	for _, ev := range l.Items {
		if ev.Source.Component == Component && strings.HasPrefix(ev.InvolvedObject.Name, prefix) {
			n += max(int(ev.Count), 1)
		}
	}
	return n
}

// decidedAction waits until the replica has decided action about node at or after
// since (the grace period of a node first seen may run first).
func (e *env) decidedAction(r *replica, node, action string, since time.Time) {
	e.t.Helper()
	e.eventually(10*time.Second, fmt.Sprintf("%s decides %s about %s", r.id, action, node), func() bool {
		for _, rec := range r.logs.find(LogDecided, map[string]string{"node": node, "action": action}) {
			if !rec.at.Before(since) {
				return true
			}
		}
		return false
	})
}

func (e *env) tainted(names []string) []string {
	e.t.Helper()
	var out []string
	for _, n := range names {
		if HasTaint(e.node(n)) {
			out = append(out, n)
		}
	}
	return out
}

// TestBreaker: agents broken on every node (a bad image at install: none was ever
// Ready) → no more nodes than the limit get the taint, the breaker reports once (one
// log line, one Warning Event, the metrics, a /readyz line) and stays so; the agents
// recover → every taint is removed and the breaker closes; a node joining then gets the
// taint and loses it when its agent is Ready; the agents broken again → no node is
// tainted (joining mode: their agents were Ready there), also after a controller
// restart; with --taint-mode=always the breaker bounds the same outage.
func TestBreaker(t *testing.T) {
	e := newEnv(t, "meshcni-taint-brk", "brk")
	const nodes = 20
	limit := Limit(nodes, 0.1, 1) // 2
	var names []string
	for i := range nodes {
		n := fmt.Sprintf("brk-%02d", i)
		names = append(names, n)
		e.createNode(n)
		e.createAgent("agent-"+n, n, false)
		if _, ok := e.node(n).Labels[corev1.LabelHostname]; ok {
			t.Fatalf("node %s has the label %s; the test wants nodes without it", n, corev1.LabelHostname)
		}
	}
	// An agent pod bound to no node (bad input): logged once, counts for no node.
	unbound := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "agent-unbound", Namespace: e.ns,
			Labels: map[string]string{"app.kubernetes.io/name": "meshcni", "app.kubernetes.io/component": "agent"}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "agent", Image: "meshcni.local/agent:test"}}},
	}
	if _, err := e.cs.CoreV1().Pods(e.ns).Create(e.ctx, unbound, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	log := e.watchTaints()
	cfg := e.breakerConfig("brk-1")
	r := e.start(cfg)
	e.eventually(5*time.Second, "brk-1 leads", r.leading)
	srv := httptest.NewServer(r.c.Handler())
	defer srv.Close()

	t.Run("agents broken on every node: no more than the limit tainted, the breaker reports once", func(t *testing.T) {
		e.t = t
		began := time.Now()
		for _, n := range names {
			e.decidedAction(r, n, "add", began.Add(-time.Minute))
		}
		e.eventually(5*time.Second, "one Warning Event "+ReasonBreakerOpen, func() bool { return e.clusterEvents("brk-", ReasonBreakerOpen) == 1 })
		// Hold it for two grace periods and every node decided again (resync by a
		// label poke): still no more than the limit.
		poked := time.Now()
		for _, n := range names {
			if _, err := e.cs.CoreV1().Nodes().Patch(e.ctx, n, types.MergePatchType, []byte(`{"metadata":{"labels":{"meshcni.test/poke":"1"}}}`), metav1.PatchOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		for _, n := range names {
			e.decided(r, n, e.ns+"/agent-"+n+" ready=false", poked)
		}
		time.Sleep(2 * cfg.GracePeriod)
		got := e.tainted(names)
		t.Logf("%d of %d nodes tainted (limit %d), at most %d at once, %s", len(got), nodes, limit, maxTainted(log), r.c.Breaker())
		if len(got) != limit || maxTainted(log) != limit {
			t.Fatalf("tainted %v (at most %d at once), want exactly %d", got, maxTainted(log), limit)
		}
		if n := len(r.logs.find(LogBreakerOpen, nil)); n != 1 {
			t.Errorf("%q logged %d times, want once", LogBreakerOpen, n)
		}
		if n := e.clusterEvents("brk-", ReasonBreakerOpen); n != 1 {
			t.Errorf("%d %s Events, want 1", n, ReasonBreakerOpen)
		}
		s := r.c.Breaker()
		if !s.Open || s.Withheld != nodes-limit || s.Limit != limit || s.Managed != nodes {
			t.Errorf("breaker %+v, want open, %d withheld, limit %d of %d", s, nodes-limit, limit, nodes)
		}
		if n := testutil.ToFloat64(r.c.Metrics.BreakerTrips); n != 1 {
			t.Errorf("breaker trips %v, want 1", n)
		}
		_, body := get(t, srv.URL+"/metrics")
		for _, want := range []string{"meshcni_taint_breaker_open 1\n", fmt.Sprintf("meshcni_taint_withheld_nodes %d\n", nodes-limit),
			fmt.Sprintf("meshcni_taint_nodes_tainted %d\n", limit), "meshcni_taint_breaker_trips_total 1\n"} {
			if !strings.Contains(body, want) {
				t.Errorf("/metrics lacks %q", want)
			}
		}
		if code, body := get(t, srv.URL+"/readyz"); code != http.StatusOK || !strings.Contains(body, "taint breaker open since") {
			t.Errorf("/readyz %d %q, want 200 with the breaker's line", code, body)
		}
		if n := len(r.logs.find(LogAgentUnbound, map[string]string{"pod": e.ns + "/agent-unbound"})); n != 1 {
			t.Errorf("%q logged %d times for the unbound pod, want once", LogAgentUnbound, n)
		}
	})

	t.Run("agents recover: every taint removed, the breaker closes", func(t *testing.T) {
		e.t = t
		for _, n := range names {
			e.setReady("agent-"+n, true)
		}
		for _, n := range names {
			e.waitTaint(n, false, 10*time.Second)
		}
		e.eventually(10*time.Second, "every node marked", func() bool {
			for _, n := range names {
				if !HasMark(e.node(n)) {
					return false
				}
			}
			return true
		})
		e.eventually(5*time.Second, "the breaker closes", func() bool { return !r.c.Breaker().Open })
		e.eventually(5*time.Second, "one "+ReasonBreakerClosed+" Event", func() bool { return e.clusterEvents("brk-", ReasonBreakerClosed) == 1 })
		if n := len(r.logs.find(LogBreakerClosed, nil)); n != 1 {
			t.Errorf("%q logged %d times, want once", LogBreakerClosed, n)
		}
		if maxTainted(log) != limit {
			t.Errorf("at most %d tainted at once, want %d", maxTainted(log), limit)
		}
		if code, body := get(t, srv.URL+"/readyz"); code != http.StatusOK || strings.Contains(body, "breaker") {
			t.Errorf("/readyz %d %q, want 200 without a breaker line", code, body)
		}
	})

	t.Run("a joining node still gets the taint and loses it when its agent is Ready", func(t *testing.T) {
		e.t = t
		e.createNode("brk-new")
		e.waitTaint("brk-new", true, 10*time.Second)
		e.createAgent("agent-brk-new", "brk-new", true)
		e.waitTaint("brk-new", false, 5*time.Second)
		if !HasMark(e.node("brk-new")) {
			t.Error("the joining node was not marked with its taint's removal")
		}
		if r.c.Breaker().Open {
			t.Error("the breaker opened for one joining node")
		}
	})
	names = append(names, "brk-new")

	t.Run("agents broken again, and a controller restart: no node tainted", func(t *testing.T) {
		e.t = t
		flips := len(log.of(""))
		broke := time.Now()
		for _, n := range names {
			e.setReady("agent-"+n, false)
		}
		time.Sleep(cfg.GracePeriod + time.Second)
		e.eventually(10*time.Second, "each node spared past its grace", func() bool {
			return len(r.logs.find(LogSpared, nil)) >= len(names)
		})
		r.stop(t)
		// A new leader (another identity, nothing in memory) reads the marks.
		r2 := e.start(e.breakerConfig("brk-2"))
		e.eventually(10*time.Second, "brk-2 leads", r2.leading)
		for _, n := range names {
			if a := e.decided(r2, n, e.ns+"/agent-"+n+" ready=false", broke); a != "none" {
				t.Errorf("brk-2 decided %q about %s, want none", a, n)
			}
		}
		time.Sleep(cfg.GracePeriod + time.Second)
		e.eventually(10*time.Second, "brk-2 spares each node past its grace", func() bool {
			return len(r2.logs.find(LogSpared, nil)) >= len(names)
		})
		if fs := log.of("")[flips:]; len(fs) > 0 {
			t.Fatalf("taints changed after the agents broke again: %+v", fs)
		}
		if r2.nodeWrites.Load() != 0 || r2.c.Breaker().Open {
			t.Errorf("brk-2: %d node writes, breaker %s; want none, closed", r2.nodeWrites.Load(), r2.c.Breaker())
		}
		r2.stop(t)
	})

	t.Run("--taint-mode=always: the breaker bounds the same outage", func(t *testing.T) {
		e.t = t
		cfg := e.breakerConfig("brk-always")
		cfg.TaintMode = Always
		r3 := e.start(cfg)
		e.eventually(10*time.Second, "brk-always leads", r3.leading)
		limit := Limit(len(names), 0.1, 1)
		e.eventually(cfg.GracePeriod+10*time.Second, "the breaker opens", func() bool { return r3.c.Breaker().Open })
		time.Sleep(2 * cfg.GracePeriod)
		got := e.tainted(names)
		t.Logf("always: %d of %d nodes tainted (limit %d), %s", len(got), len(names), limit, r3.c.Breaker())
		if len(got) != limit || r3.c.Breaker().Withheld != len(names)-limit {
			t.Fatalf("tainted %v, breaker %s; want %d tainted and the rest withheld", got, r3.c.Breaker(), limit)
		}
		if n := len(r3.logs.find(LogBreakerOpen, nil)); n != 1 {
			t.Errorf("%q logged %d times, want once", LogBreakerOpen, n)
		}
		// Removal goes on while it is open: a tainted node's agent turns Ready.
		e.setReady("agent-"+got[0], true)
		e.waitTaint(got[0], false, 5*time.Second)
		// One room free, but more nodes are due than fit: nothing else tainted.
		time.Sleep(cfg.GracePeriod)
		if now := e.tainted(names); len(now) != limit-1 {
			t.Errorf("after a removal with the breaker open: tainted %v, want %d", now, limit-1)
		}
	})
}
