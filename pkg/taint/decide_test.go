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
	pol := Policy{Grace: grace, TaintNewNodes: true}
	noNew := Policy{Grace: grace}
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
	}{
		// Ready agent pod.
		{name: "ready agent, tainted: remove", node: node(old, otherKey, ours), agents: []*corev1.Pod{agentPod("a")}, pol: pol,
			want: Remove, reason: "meshcni/a is Ready", wantState: NodeState{FirstSeen: t0, SeenReady: true}, checkState: true},
		{name: "ready agent, untainted: nothing", node: node(old), agents: []*corev1.Pod{agentPod("a")}, st: lost(5 * time.Second), pol: pol,
			want: None, wantState: seenReady, checkState: true},
		{name: "ready agent among a terminating one (surge rollout)", node: node(old, ours), agents: []*corev1.Pod{agentPod("old", deleting), agentPod("new")}, pol: pol,
			want: Remove, reason: "meshcni/new is Ready"},
		{name: "ready agent, only another effect of our key: nothing", node: node(old, ourKeyNoE), agents: []*corev1.Pod{agentPod("a")}, pol: pol, want: None},

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
		{name: "zero grace: add at once", node: node(old), st: seenReady, pol: Policy{}, want: Add},
		{name: "old node first seen without agent (controller restart): grace from first sight", node: node(old), pol: pol,
			want: None, requeue: grace, wantState: NodeState{FirstSeen: t0, NotReadySince: t0}, checkState: true},
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
	pol := Policy{Grace: 30 * time.Second, TaintNewNodes: true}
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
