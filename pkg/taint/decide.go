// Package taint is meshcni's taint controller: it puts the taint
// cni.istio.io/not-ready:NoSchedule on a managed node whose meshcni agent pod has never
// been Ready there (a joining node; with --taint-mode=always, on any node whose agent
// pod is not Ready), so that no pod is scheduled onto a node where the redirect cannot
// be set up yet, and removes it once the agent pod is Ready. It never taints more than
// --max-tainted-fraction of the managed nodes (the breaker). It runs as its own
// Deployment with Lease-based leader election (cmd/meshcni-taint-controller); see
// docs/taint.md.
//
// This file is the pure decision: given a node, the agent pods bound to it, what the
// controller remembers about the node and the time, which taint change is due; and the
// breaker's arithmetic.
package taint

import (
	"fmt"
	"math"
	"time"

	corev1 "k8s.io/api/core/v1"
)

// The taint the controller manages. Only a taint with this key AND this effect is
// meshcni's: a taint with the same key and another effect is left alone.
const (
	TaintKey    = "cni.istio.io/not-ready"
	TaintEffect = corev1.TaintEffectNoSchedule
)

// MarkAnnotation on a Node records that a meshcni agent pod was Ready there (its value:
// when the controller first saw that, RFC 3339 in UTC, whole seconds). The controller
// writes it once and never changes or removes it; with --taint-mode=joining a node that
// carries it is never tainted again. Removing it by hand makes the node count as
// joining.
const MarkAnnotation = "meshcni.io/agent-was-ready"

// MarkValue is the annotation's value for a first sight at t.
func MarkValue(t time.Time) string { return t.UTC().Truncate(time.Second).Format(time.RFC3339) }

// HasMark reports whether the node carries MarkAnnotation (any value).
func HasMark(n *corev1.Node) bool {
	_, ok := n.Annotations[MarkAnnotation]
	return ok
}

// Taint returns the managed taint.
func Taint() corev1.Taint { return corev1.Taint{Key: TaintKey, Effect: TaintEffect} }

func isOurs(t corev1.Taint) bool { return t.Key == TaintKey && t.Effect == TaintEffect }

// HasTaint reports whether the node carries the managed taint.
func HasTaint(n *corev1.Node) bool {
	for _, t := range n.Spec.Taints {
		if isOurs(t) {
			return true
		}
	}
	return false
}

// WithTaint returns taints with the managed taint present (want) or absent, every other
// taint kept in its order, and whether that differs from taints. taints is not modified.
func WithTaint(taints []corev1.Taint, want bool) ([]corev1.Taint, bool) {
	out := make([]corev1.Taint, 0, len(taints)+1)
	had := false
	for _, t := range taints {
		if isOurs(t) {
			if had || !want { // drop duplicates, or all of ours when removing
				had = true
				continue
			}
			had = true
		}
		out = append(out, t)
	}
	switch {
	case want && !had:
		return append(out, Taint()), true
	case !want && had:
		return out, true
	}
	return out, len(out) != len(taints)
}

// AgentPodReady reports whether an agent pod counts as Ready: not being deleted, phase
// Running and its Ready condition True. A terminating pod is leaving the node, so it
// does not count even while its last status still says Ready.
func AgentPodReady(p *corev1.Pod) bool {
	if p.DeletionTimestamp != nil || p.Status.Phase != corev1.PodRunning {
		return false
	}
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// NodeState is what the controller remembers about a node between two decisions. The
// zero value is a node never seen before.
type NodeState struct {
	// FirstSeen is when the controller (this leader) first decided about the node.
	FirstSeen time.Time
	// SeenReady: an agent pod on the node was Ready at some decision.
	SeenReady bool
	// NotReadySince is when the controller first saw the node without a Ready agent
	// pod, after it last had one; zero while one is Ready.
	NotReadySince time.Time
	// Spared: the node was left untainted past its grace period because its agent was
	// Ready there before (--taint-mode=joining), since NotReadySince; logged once.
	Spared bool
}

// Mode says which nodes the controller taints.
type Mode int

// The modes. The zero value is Joining.
const (
	// Joining taints only nodes whose agent pod was never Ready there (neither the
	// node's MarkAnnotation nor this leader's memory says so).
	Joining Mode = iota
	// Always taints any node whose agent pod is not Ready past the grace period.
	Always
)

func (m Mode) String() string {
	if m == Always {
		return "always"
	}
	return "joining"
}

// ParseMode reads a --taint-mode value.
func ParseMode(s string) (Mode, error) {
	switch s {
	case "joining":
		return Joining, nil
	case "always":
		return Always, nil
	}
	return 0, fmt.Errorf("--taint-mode %q: want joining or always", s)
}

// Policy holds the settings the decision depends on.
type Policy struct {
	// Grace is how long a node may be without a Ready agent pod before it is tainted
	// (a rolling update of the agent replaces the pod well within it).
	Grace time.Duration
	// TaintNewNodes taints at once a new node without a Ready agent pod: one created
	// no more than Grace before the controller first saw it, and never seen with a
	// Ready agent pod.
	TaintNewNodes bool
	// Mode: Joining (taint only nodes whose agent was never Ready there) or Always.
	Mode Mode
}

// Action is a taint change.
type Action int

// The taint changes.
const (
	None Action = iota
	Add
	Remove
)

func (a Action) String() string {
	switch a {
	case Add:
		return "add"
	case Remove:
		return "remove"
	}
	return "none"
}

// Decision is what to do about a node now.
type Decision struct {
	Action Action
	// Reason says why, for logs and Events.
	Reason string
	// RequeueAfter > 0: decide again after that long (a grace period is running).
	RequeueAfter time.Duration
	// Mark: write MarkAnnotation (an agent pod is Ready and the node lacks it), with
	// the taint's removal if any, else on its own.
	Mark bool
	// Spared is set, once per loss of the agent, when the node is past its grace
	// period and left untainted because its agent was Ready there before (Joining).
	Spared bool
}

// Decide returns the taint change due on node at now, given the agent pods bound to it
// (any number: a rolling update may briefly run two), the remembered state, and the
// policy; and the state to remember. It is pure.
func Decide(node *corev1.Node, agents []*corev1.Pod, st NodeState, now time.Time, p Policy) (Decision, NodeState) {
	first := st.FirstSeen.IsZero()
	if first {
		st.FirstSeen = now
	}
	tainted := HasTaint(node)
	marked := HasMark(node)
	var ready, present *corev1.Pod
	for _, a := range agents {
		if AgentPodReady(a) {
			ready = a
			break
		}
		if present == nil || a.DeletionTimestamp == nil {
			present = a
		}
	}
	if ready != nil {
		st.SeenReady = true
		st.NotReadySince, st.Spared = time.Time{}, false
		if tainted {
			return Decision{Action: Remove, Mark: !marked, Reason: fmt.Sprintf("meshcni agent pod %s/%s is Ready", ready.Namespace, ready.Name)}, st
		}
		return Decision{Mark: !marked}, st
	}
	seenReady := st.SeenReady || marked
	if st.NotReadySince.IsZero() {
		st.NotReadySince = now
	}
	if tainted {
		return Decision{}, st
	}
	what := "no meshcni agent pod"
	if present != nil {
		what = fmt.Sprintf("meshcni agent pod %s/%s not Ready", present.Namespace, present.Name)
	}
	if p.TaintNewNodes && !seenReady && !node.CreationTimestamp.IsZero() &&
		st.FirstSeen.Sub(node.CreationTimestamp.Time) <= p.Grace {
		return Decision{Action: Add, Reason: "new node, " + what}, st
	}
	if left := st.NotReadySince.Add(p.Grace).Sub(now); left > 0 {
		return Decision{RequeueAfter: left}, st
	}
	lasted := fmt.Sprintf("%s for %s (grace period %s)", what, now.Sub(st.NotReadySince).Round(time.Millisecond), p.Grace)
	if p.Mode == Joining && seenReady {
		d := Decision{Reason: lasted + "; not tainted: its agent was Ready on it before (--taint-mode=joining)", Spared: !st.Spared}
		st.Spared = true
		return d, st
	}
	return Decision{Action: Add, Reason: lasted}, st
}

// Limit is the most managed nodes that may carry the taint at once: fraction of the
// managed nodes, rounded down, and never fewer than floor (so that a small cluster can
// still taint a joining node). A node past the limit is not tainted (the breaker).
func Limit(managed int, fraction float64, floor int) int {
	// The epsilon keeps 0.29 × 100 at 29, not 28.999….
	n := int(math.Floor(fraction*float64(managed) + 1e-9))
	return max(n, floor)
}

// Admit reports whether one more node may get the taint: tainted nodes carry it now,
// and wanting nodes (the one asking included) are due to get it. It is admitted only
// while every node due to get the taint fits within limit, so that the breaker, once
// open, adds no taint until the nodes that want one fit again.
func Admit(tainted, wanting, limit int) bool { return tainted+wanting <= limit }
