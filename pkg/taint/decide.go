// Package taint is meshcni's taint controller: it keeps the taint
// cni.istio.io/not-ready:NoSchedule on every managed node whose meshcni agent pod is not
// Ready, so that no pod is scheduled onto a node where the redirect cannot be set up yet,
// and removes it once the agent pod is Ready. It runs as its own Deployment with
// Lease-based leader election (cmd/meshcni-taint-controller); see docs/taint.md.
//
// This file is the pure decision: given a node, the agent pods bound to it, what the
// controller remembers about the node and the time, which taint change is due.
package taint

import (
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
)

// The taint the controller manages. Only a taint with this key AND this effect is
// meshcni's: a taint with the same key and another effect is left alone.
const (
	TaintKey    = "cni.istio.io/not-ready"
	TaintEffect = corev1.TaintEffectNoSchedule
)

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
		st.NotReadySince = time.Time{}
		if tainted {
			return Decision{Action: Remove, Reason: fmt.Sprintf("meshcni agent pod %s/%s is Ready", ready.Namespace, ready.Name)}, st
		}
		return Decision{}, st
	}
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
	if p.TaintNewNodes && !st.SeenReady && !node.CreationTimestamp.IsZero() &&
		st.FirstSeen.Sub(node.CreationTimestamp.Time) <= p.Grace {
		return Decision{Action: Add, Reason: "new node, " + what}, st
	}
	if left := st.NotReadySince.Add(p.Grace).Sub(now); left > 0 {
		return Decision{RequeueAfter: left}, st
	}
	return Decision{Action: Add, Reason: fmt.Sprintf("%s for %s (grace period %s)", what, now.Sub(st.NotReadySince).Round(time.Millisecond), p.Grace)}, st
}
