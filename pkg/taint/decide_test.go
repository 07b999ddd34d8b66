package taint

import (
	"reflect"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

var t0 = time.Date(2026, 11, 30, 10, 0, 0, 0, time.UTC)

func node(created time.Time, taints ...corev1.Taint) *corev1.Node {
	return &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: "n1", CreationTimestamp: metav1.NewTime(created)},
		Spec:       corev1.NodeSpec{Taints: taints},
	}
}

type podOpt func(*corev1.Pod)

func agentPod(name string, opts ...podOpt) *corev1.Pod {
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "meshcni", Name: name},
		Spec:       corev1.PodSpec{NodeName: "n1"},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, Conditions: []corev1.PodCondition{
			{Type: corev1.PodScheduled, Status: corev1.ConditionTrue},
			{Type: corev1.PodReady, Status: corev1.ConditionTrue},
		}},
	}
	for _, o := range opts {
		o(p)
	}
	return p
}

var (
	notReady podOpt = func(p *corev1.Pod) { p.Status.Conditions[1].Status = corev1.ConditionFalse }
	pending  podOpt = func(p *corev1.Pod) { p.Status.Phase = corev1.PodPending }
	noCond   podOpt = func(p *corev1.Pod) { p.Status.Conditions = p.Status.Conditions[:1] }
	deleting podOpt = func(p *corev1.Pod) { now := metav1.NewTime(t0); p.DeletionTimestamp = &now }
)

var (
	ours      = Taint()
	otherKey  = corev1.Taint{Key: "node.cloudprovider.kubernetes.io/uninitialized", Value: "true", Effect: corev1.TaintEffectNoSchedule}
	ourKeyNoE = corev1.Taint{Key: TaintKey, Effect: corev1.TaintEffectNoExecute}
)

func TestAgentPodReady(t *testing.T) {
	for _, tc := range []struct {
		name string
		pod  *corev1.Pod
		want bool
	}{
		{"running and Ready", agentPod("a"), true},
		{"Ready condition false", agentPod("a", notReady), false},
		{"no Ready condition", agentPod("a", noCond), false},
		{"pending with a stale Ready", agentPod("a", pending), false},
		{"terminating while still Ready", agentPod("a", deleting), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := AgentPodReady(tc.pod); got != tc.want {
				t.Fatalf("AgentPodReady = %v, want %v", got, tc.want)
			}
		})
	}
}

func TestWithTaint(t *testing.T) {
	for _, tc := range []struct {
		name        string
		in          []corev1.Taint
		want        bool
		out         []corev1.Taint
		wantChanged bool
	}{
		{"add to none", nil, true, []corev1.Taint{ours}, true},
		{"add after others, kept in order", []corev1.Taint{otherKey, ourKeyNoE}, true, []corev1.Taint{otherKey, ourKeyNoE, ours}, true},
		{"add when present", []corev1.Taint{otherKey, ours}, true, []corev1.Taint{otherKey, ours}, false},
		{"add drops a duplicate", []corev1.Taint{ours, otherKey, ours}, true, []corev1.Taint{ours, otherKey}, true},
		{"remove keeps others and the other effect", []corev1.Taint{ourKeyNoE, ours, otherKey}, false, []corev1.Taint{ourKeyNoE, otherKey}, true},
		{"remove every copy", []corev1.Taint{ours, ours}, false, []corev1.Taint{}, true},
		{"remove when absent", []corev1.Taint{otherKey}, false, []corev1.Taint{otherKey}, false},
		{"remove from none", nil, false, []corev1.Taint{}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := append([]corev1.Taint(nil), tc.in...)
			out, changed := WithTaint(in, tc.want)
			if !reflect.DeepEqual(out, tc.out) || changed != tc.wantChanged {
				t.Fatalf("WithTaint = %v, %v; want %v, %v", out, changed, tc.out, tc.wantChanged)
			}
			if !reflect.DeepEqual(in, tc.in) {
				t.Fatalf("input modified: %v", in)
			}
		})
	}
}

func TestDecide(t *testing.T) {
	grace := 30 * time.Second
	old := t0.Add(-time.Hour) // a node created long before the controller saw it
	pol := Policy{Grace: grace, TaintNewNodes: true, Mode: Always}
	noNew := Policy{Grace: grace, Mode: Always}
	joining := Policy{Grace: grace, TaintNewNodes: true, Mode: Joining}
	marked := func(n *corev1.Node) *corev1.Node {
		n.Annotations = map[string]string{MarkAnnotation: MarkValue(t0.Add(-time.Hour))}
		return n
	}
	seenReady := NodeState{FirstSeen: t0.Add(-time.Hour), SeenReady: true}
	lost := func(ago time.Duration) NodeState {
		return NodeState{FirstSeen: t0.Add(-time.Hour), SeenReady: true, NotReadySince: t0.Add(-ago)}
	}
	for _, tc := range []struct {
		name       string
		node       *corev1.Node
		agents     []*corev1.Pod
		st         NodeState
		pol        Policy
		want       Action
		reason     string // substring of the reason
		requeue    time.Duration
		wantState  NodeState
		checkState bool
		mark       bool // Decision.Mark
		spared     bool // Decision.Spared
	}{
		// Ready agent pod.
		{name: "ready agent, tainted: remove", node: node(old, otherKey, ours), agents: []*corev1.Pod{agentPod("a")}, pol: pol,
			want: Remove, mark: true, reason: "meshcni/a is Ready", wantState: NodeState{FirstSeen: t0, SeenReady: true}, checkState: true},
		{name: "ready agent, tainted, marked: remove, no mark", node: marked(node(old, ours)), agents: []*corev1.Pod{agentPod("a")}, pol: pol,
			want: Remove, reason: "meshcni/a is Ready"},
		{name: "ready agent, untainted, unmarked: mark only", node: node(old), agents: []*corev1.Pod{agentPod("a")}, pol: joining,
			want: None, mark: true, wantState: NodeState{FirstSeen: t0, SeenReady: true}, checkState: true},
		{name: "ready agent, untainted, marked: nothing", node: marked(node(old)), agents: []*corev1.Pod{agentPod("a")}, pol: joining, want: None},
		{name: "ready agent, untainted: nothing but the mark", node: node(old), agents: []*corev1.Pod{agentPod("a")}, st: lost(5 * time.Second), pol: pol,
			want: None, mark: true, wantState: seenReady, checkState: true},
		{name: "ready agent among a terminating one (surge rollout)", node: node(old, ours), agents: []*corev1.Pod{agentPod("old", deleting), agentPod("new")}, pol: pol,
			want: Remove, mark: true, reason: "meshcni/new is Ready"},
		{name: "ready agent, only another effect of our key: nothing", node: marked(node(old, ourKeyNoE)), agents: []*corev1.Pod{agentPod("a")}, pol: pol, want: None},

		// New nodes.
		{name: "new node, no agent: add", node: node(t0.Add(-2 * time.Second)), pol: pol,
			want: Add, reason: "new node, no meshcni agent pod", wantState: NodeState{FirstSeen: t0, NotReadySince: t0}, checkState: true},
		{name: "new node, agent not Ready: add", node: node(t0), agents: []*corev1.Pod{agentPod("a", notReady)}, pol: pol,
			want: Add, reason: "meshcni/a not Ready"},
		{name: "new node created exactly grace ago: add", node: node(t0.Add(-grace)), pol: pol, want: Add},
		{name: "node created just before the grace: not new, wait", node: node(t0.Add(-grace - time.Second)), pol: pol,
			want: None, requeue: grace, wantState: NodeState{FirstSeen: t0, NotReadySince: t0}, checkState: true},
		{name: "new node, --taint-new-nodes=false: wait the grace", node: node(t0), pol: noNew, want: None, requeue: grace},
		{name: "new node already tainted (startup taint): keep", node: node(t0, otherKey, ours), pol: pol, want: None},
		{name: "seen before (first seen long after creation): not new", node: node(t0.Add(-10 * time.Second)),
			st: NodeState{FirstSeen: t0.Add(-5 * time.Second), NotReadySince: t0.Add(-5 * time.Second)}, pol: pol, want: Add},
		{name: "node that had a Ready agent is never new", node: node(t0.Add(-time.Second)),
			st: NodeState{FirstSeen: t0.Add(-time.Second), SeenReady: true}, pol: pol, want: None, requeue: grace},
		{name: "node without creation time is not new", node: node(time.Time{}), pol: pol, want: None, requeue: grace},

		// Agent lost: grace period.
		{name: "agent gone just now: wait the whole grace", node: node(old), st: seenReady, pol: pol,
			want: None, requeue: grace, wantState: NodeState{FirstSeen: seenReady.FirstSeen, SeenReady: true, NotReadySince: t0}, checkState: true},
		{name: "agent gone 10s ago: wait the rest", node: node(old), st: lost(10 * time.Second), pol: pol, want: None, requeue: 20 * time.Second,
			wantState: lost(10 * time.Second), checkState: true},
		{name: "agent not Ready 29.999s: still wait", node: node(old), agents: []*corev1.Pod{agentPod("a", notReady)}, st: lost(grace - time.Millisecond), pol: pol,
			want: None, requeue: time.Millisecond},
		{name: "agent gone for the grace: add", node: node(old, otherKey), st: lost(grace), pol: pol,
			want: Add, reason: "no meshcni agent pod for 30s (grace period 30s)"},
		{name: "agent not Ready past the grace: add", node: node(old), agents: []*corev1.Pod{agentPod("a", notReady)}, st: lost(time.Minute), pol: pol,
			want: Add, reason: "meshcni/a not Ready for 1m0s"},
		{name: "only a terminating agent past the grace: add", node: node(old), agents: []*corev1.Pod{agentPod("a", deleting)}, st: lost(time.Minute), pol: pol,
			want: Add, reason: "meshcni/a not Ready"},
		{name: "replacement pending, terminating old: reason names the replacement", node: node(old), agents: []*corev1.Pod{agentPod("old", deleting), agentPod("new", pending)}, st: lost(time.Minute), pol: pol,
			want: Add, reason: "meshcni/new not Ready"},
		{name: "agent lost, already tainted: keep", node: node(old, ours), st: lost(time.Hour), pol: pol, want: None},
		{name: "zero grace: add at once", node: node(old), st: seenReady, pol: Policy{Mode: Always}, want: Add},
		{name: "old node first seen without agent (controller restart): grace from first sight", node: node(old), pol: pol,
			want: None, requeue: grace, wantState: NodeState{FirstSeen: t0, NotReadySince: t0}, checkState: true},

		// --taint-mode=joining: a node whose agent was Ready there is never tainted.
		{name: "joining: new node, no agent: add", node: node(t0.Add(-2 * time.Second)), pol: joining, want: Add, reason: "new node, no meshcni agent pod"},
		{name: "joining: never Ready, past the grace: add", node: node(old), st: NodeState{FirstSeen: t0.Add(-10 * time.Minute), NotReadySince: t0.Add(-time.Minute)}, pol: joining,
			want: Add, reason: "no meshcni agent pod for 1m0s"},
		{name: "joining: seen Ready by this leader, past the grace: spared once", node: node(old), st: lost(time.Minute), pol: joining,
			want: None, spared: true, reason: "not tainted: its agent was Ready on it before (--taint-mode=joining)",
			wantState: NodeState{FirstSeen: t0.Add(-time.Hour), SeenReady: true, NotReadySince: t0.Add(-time.Minute), Spared: true}, checkState: true},
		{name: "joining: spared already: not again", node: node(old), agents: []*corev1.Pod{agentPod("a", notReady)},
			st: NodeState{FirstSeen: t0.Add(-time.Hour), SeenReady: true, NotReadySince: t0.Add(-time.Hour), Spared: true}, pol: joining, want: None, reason: "not tainted"},
		{name: "joining: marked node first seen after a restart, past the grace: spared", node: marked(node(old)),
			st: NodeState{FirstSeen: t0.Add(-time.Minute), NotReadySince: t0.Add(-time.Minute)}, pol: joining, want: None, spared: true},
		{name: "joining: marked node is never new", node: marked(node(t0.Add(-time.Second))), pol: joining, want: None, requeue: grace},
		{name: "joining: marked node within the grace: wait", node: marked(node(old)), agents: []*corev1.Pod{agentPod("a", notReady)},
			st: lost(10 * time.Second), pol: joining, want: None, requeue: 20 * time.Second},
		{name: "joining: marked and tainted (by hand, or in always mode): kept", node: marked(node(old, ours)), st: lost(time.Hour), pol: joining, want: None},
		{name: "joining: marked, Ready again: remove", node: marked(node(old, ours)), agents: []*corev1.Pod{agentPod("a")}, pol: joining, want: Remove},
		{name: "always: marked node past the grace: add", node: marked(node(old)), st: lost(time.Minute), pol: pol, want: Add, reason: "for 1m0s"},
		{name: "joining, zero grace: seen Ready, spared at once", node: node(old), st: seenReady, pol: Policy{Mode: Joining}, want: None, spared: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := tc.node.DeepCopy()
			d, st := Decide(tc.node, tc.agents, tc.st, t0, tc.pol)
			if d.Action != tc.want {
				t.Fatalf("action %s (%q), want %s", d.Action, d.Reason, tc.want)
			}
			if !strings.Contains(d.Reason, tc.reason) {
				t.Errorf("reason %q lacks %q", d.Reason, tc.reason)
			}
			if d.Action != None && d.Reason == "" {
				t.Error("a change without a reason")
			}
			if d.Mark != tc.mark || d.Spared != tc.spared {
				t.Errorf("mark %v, spared %v; want %v, %v", d.Mark, d.Spared, tc.mark, tc.spared)
			}
			if d.RequeueAfter != tc.requeue {
				t.Errorf("requeue after %s, want %s", d.RequeueAfter, tc.requeue)
			}
			if tc.checkState && st != tc.wantState {
				t.Errorf("state %+v, want %+v", st, tc.wantState)
			}
			if !reflect.DeepEqual(before, tc.node) {
				t.Error("Decide modified the node")
			}
		})
	}
}

// TestDecideRollover walks a rolling update of the agent through time: the node is
// never tainted while the replacement becomes Ready within the grace period, and is
// tainted once the grace passes without one.
func TestDecideRollover(t *testing.T) {
	pol := Policy{Grace: 30 * time.Second, TaintNewNodes: true, Mode: Always}
	n := node(t0.Add(-time.Hour))
	var st NodeState
	step := func(at time.Duration, agents ...*corev1.Pod) Decision {
		t.Helper()
		var d Decision
		d, st = Decide(n, agents, st, t0.Add(at), pol)
		return d
	}
	if d := step(0, agentPod("old")); d.Action != None {
		t.Fatalf("ready: %v", d)
	}
	if d := step(time.Second, agentPod("old", deleting)); d.Action != None || d.RequeueAfter != 30*time.Second {
		t.Fatalf("old terminating: %+v", d)
	}
	if d := step(3*time.Second, agentPod("new", pending)); d.Action != None || d.RequeueAfter != 28*time.Second {
		t.Fatalf("new pending: %+v", d)
	}
	if d := step(20*time.Second, agentPod("new")); d.Action != None || !st.NotReadySince.IsZero() {
		t.Fatalf("new ready: %+v %+v", d, st)
	}
	// The replacement fails: the grace starts again from its loss.
	if d := step(40*time.Second, agentPod("new", notReady)); d.Action != None || d.RequeueAfter != 30*time.Second {
		t.Fatalf("new not ready: %+v", d)
	}
	if d := step(70*time.Second, agentPod("new", notReady)); d.Action != Add {
		t.Fatalf("past grace: %+v", d)
	}
}

// TestLimit: the most nodes that may carry the taint, written out by hand for each
// cluster size.
func TestLimit(t *testing.T) {
	for _, tc := range []struct {
		managed  int
		fraction float64
		floor    int
		want     int
	}{
		{0, 0.1, 1, 1},        // no node yet: the floor
		{3, 0.1, 1, 1},        // 0.3 rounds down to 0: the floor lets one joining node be tainted
		{3, 0.1, 0, 0},        // no floor: nothing
		{9, 0.1, 1, 1},        // 0.9
		{10, 0.1, 1, 1},       // exactly 1
		{19, 0.1, 1, 1},       // 1.9 rounds down
		{20, 0.1, 1, 2},       // 2
		{100, 0.29, 1, 29},    // 28.999… in floating point: still 29
		{5000, 0.1, 1, 500},   // a large cluster
		{5000, 0.1, 600, 600}, // a floor above the fraction wins
		{7, 1, 0, 7},          // fraction 1: every node
		{7, 0, 0, 0},          // 0 and 0: remove only
		{7, 0, 2, 2},
	} {
		if got := Limit(tc.managed, tc.fraction, tc.floor); got != tc.want {
			t.Errorf("Limit(%d, %v, %d) = %d, want %d", tc.managed, tc.fraction, tc.floor, got, tc.want)
		}
	}
}

func TestAdmit(t *testing.T) {
	for _, tc := range []struct {
		tainted, wanting, limit int
		want                    bool
	}{
		{0, 1, 1, true},  // the first joining node of a small cluster
		{1, 1, 1, false}, // a second one: past the limit
		{0, 2, 1, false}, // two due at once, room for one: neither (no taint moves between them)
		{0, 2, 2, true},
		{9, 1, 10, true}, // the tenth of ten allowed
		{10, 1, 10, false},
		{12, 1, 10, false}, // already past it (startup taints count)
		{0, 1, 0, false},   // remove only
	} {
		if got := Admit(tc.tainted, tc.wanting, tc.limit); got != tc.want {
			t.Errorf("Admit(%d, %d, %d) = %v, want %v", tc.tainted, tc.wanting, tc.limit, got, tc.want)
		}
	}
}

// TestBreakerEpisode walks the breaker through a fleet-wide agent failure on three
// nodes with a limit of one: the first due node is admitted, the others are withheld
// and the breaker opens once; it stays open while they are due, and closes when the
// last one is no longer due. A withheld node that fits again is handed back to decide.
func TestBreakerEpisode(t *testing.T) {
	b := newBreaker()
	type step struct {
		do                    string // "ask" or "settle"
		node                  string
		tainted, limit        int
		admit, opened, closed bool
		retry                 []string
		open                  bool
		withheld              int
	}
	for i, s := range []step{
		{do: "ask", node: "n1", tainted: 0, limit: 1, admit: true, withheld: 0},
		{do: "ask", node: "n2", tainted: 1, limit: 1, opened: true, open: true, withheld: 1},
		{do: "ask", node: "n3", tainted: 1, limit: 1, open: true, withheld: 2},
		{do: "ask", node: "n2", tainted: 1, limit: 1, open: true, withheld: 2},                           // asked again: still withheld, no second opening
		{do: "settle", node: "n1", tainted: 0, limit: 1, open: true, withheld: 2},                        // n1's agent Ready: room for one, but two are due
		{do: "settle", node: "n2", tainted: 0, limit: 1, open: true, withheld: 1, retry: []string{"n3"}}, // n2's agent Ready: n3 fits
		{do: "ask", node: "n3", tainted: 0, limit: 1, admit: true, closed: true, withheld: 0},
		{do: "settle", node: "n3", tainted: 0, limit: 1, withheld: 0},                        // closed: nothing
		{do: "ask", node: "n4", tainted: 1, limit: 1, opened: true, open: true, withheld: 1}, // a new episode
		{do: "settle", node: "n4", tainted: 1, limit: 1, closed: true, withheld: 0},          // its node is gone
	} {
		var admit, opened, closed bool
		var retry []string
		if s.do == "ask" {
			admit, opened, closed = b.ask(s.node, 3, s.tainted, s.limit, t0.Add(time.Duration(i)*time.Second))
		} else {
			closed, retry = b.settle(s.node, 3, s.tainted, s.limit)
		}
		st := b.state()
		if admit != s.admit || opened != s.opened || closed != s.closed || !reflect.DeepEqual(retry, s.retry) || st.Open != s.open || st.Withheld != s.withheld {
			t.Fatalf("step %d %s %s: admit %v opened %v closed %v retry %v open %v withheld %d; want %v %v %v %v %v %d",
				i, s.do, s.node, admit, opened, closed, retry, st.Open, st.Withheld, s.admit, s.opened, s.closed, s.retry, s.open, s.withheld)
		}
	}
}

// TestCensus: taints this leader wrote count until the cache shows them, for at most
// pendingFor.
func TestCensus(t *testing.T) {
	c := newCensus()
	n := func(name string, taints ...corev1.Taint) *corev1.Node {
		return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: corev1.NodeSpec{Taints: taints}}
	}
	check := func(what string, at time.Time, managed, tainted int) {
		t.Helper()
		if m, tt := c.count(at); m != managed || tt != tainted {
			t.Errorf("%s: %d managed, %d tainted; want %d, %d", what, m, tt, managed, tainted)
		}
	}
	c.see(n("a"))
	c.see(n("b", otherKey))
	c.see(n("c", ours))
	check("cache", t0, 3, 1)
	c.added("a", t0)
	check("an add the cache does not show yet", t0.Add(time.Second), 3, 2)
	c.see(n("a")) // an older version arrives late
	check("an older version after the add", t0.Add(2*time.Second), 3, 2)
	c.see(n("a", ours))
	check("the add in the cache", t0.Add(3*time.Second), 3, 2)
	c.see(n("a"))
	check("removed by someone else", t0.Add(4*time.Second), 3, 1)
	c.added("b", t0)
	check("pending past pendingFor", t0.Add(pendingFor+time.Second), 3, 1)
	c.added("b", t0)
	c.forget("b")
	check("a node gone", t0, 2, 1)
}

// TestNodePatch: the patch the controller sends, byte for byte.
func TestNodePatch(t *testing.T) {
	base := node(t0, otherKey)
	base.ResourceVersion = "42"
	mark := MarkValue(t0)
	for _, tc := range []struct {
		name   string
		base   *corev1.Node
		action Action
		mark   string
		want   string // "": no patch
	}{
		{"add", base, Add, "", `{"metadata":{"resourceVersion":"42"},"spec":{"taints":[{"key":"node.cloudprovider.kubernetes.io/uninitialized","value":"true","effect":"NoSchedule"},{"key":"cni.istio.io/not-ready","effect":"NoSchedule"}]}}`},
		{"remove the only taint", withRV(node(t0, ours), "7"), Remove, "", `{"metadata":{"resourceVersion":"7"},"spec":{"taints":null}}`},
		{"remove and mark", withRV(node(t0, ours), "7"), Remove, mark, `{"metadata":{"resourceVersion":"7","annotations":{"meshcni.io/agent-was-ready":"2026-11-30T10:00:00Z"}},"spec":{"taints":null}}`},
		{"mark only", base, None, mark, `{"metadata":{"resourceVersion":"42","annotations":{"meshcni.io/agent-was-ready":"2026-11-30T10:00:00Z"}}}`},
		{"mark when marked: nothing", withMark(base), None, mark, ""},
		{"remove when absent: nothing", base, Remove, "", ""},
		{"remove when absent, marked: nothing", withMark(base), Remove, mark, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			body, changed, err := NodePatch(tc.base, tc.action, tc.mark)
			if err != nil {
				t.Fatal(err)
			}
			if string(body) != tc.want || changed != (tc.want != "") {
				t.Errorf("patch %s (changed %v), want %s", body, changed, tc.want)
			}
		})
	}
	if v := MarkValue(time.Date(2026, 1, 2, 3, 4, 5, 999, time.FixedZone("x", 3600))); v != "2026-01-02T02:04:05Z" {
		t.Errorf("MarkValue = %q", v)
	}
}

func withRV(n *corev1.Node, rv string) *corev1.Node { n.ResourceVersion = rv; return n }
func withMark(n *corev1.Node) *corev1.Node {
	n = n.DeepCopy()
	n.Annotations = map[string]string{MarkAnnotation: "2026-01-01T00:00:00Z"}
	return n
}
