// Package audit is the node agent's self-healing: it compares the live redirect in
// the network namespace of every meshed pod of its node with the spec the pod's
// annotations give (engine.CheckReport), at start, when a pod's containers start and
// periodically, and handles drift by the configured action:
//
//   - repair (default): re-apply the pod's redirect atomically, in place;
//   - report: change nothing; the Event, the metric and the log line say what changed;
//   - evict (escaped pods only, opt-in; the escaped pods' default is repair): a pod
//     with no meshcni redirect at all, no validation init container and no record
//     of its sandbox's ADD — its sandbox was created while meshcni was not in the
//     CNI chain — is evicted (pkg/heal: the Eviction API, PodDisruptionBudgets,
//     never a bare or mirror pod, the node's budget and circuit breaker) so its
//     controller recreates it through the chain.
//
// Pods the plugin deliberately skips (capture.Decide) are never touched. The spec a
// pod was redirected with is remembered (first audit, or the last repair; across
// the agent's restarts through Options.Applied, which the agent fills at the
// sandbox's ADD): a later change of its annotations is reported, not applied
// (Istio re-reads none), unless FollowAnnotations is set.
//
// A pod's namespace is its sandbox's (podnetns.Locator: the netns recorded at ADD,
// verified, else the one of the pod's cgroup, cross-checked), never the one that
// holds its IP: a namespace not verified to be the pod's is reported (Event
// MeshcniSandboxUnverified, meshcni_audit_refused_total) and nothing is done.
//
// Cost is bounded: a round enters each pod's namespace once (the namespace is
// located once, then reopened by the path it was located through while its device,
// inode and cookie are the same), rounds are spread over the
// period, at most Concurrency pods are checked at a time, and a pod whose namespace
// is gone is dropped until its containers start again.
//
// The decisions (this file) are pure; the Auditor (audit.go, round.go) runs them.
package audit

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"

	corev1 "k8s.io/api/core/v1"

	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/capture/k8spod"
	"github.com/meshcni/meshcni/pkg/engine"
	"github.com/meshcni/meshcni/pkg/heal"
	"github.com/meshcni/meshcni/pkg/sandboxstate"
	"github.com/meshcni/meshcni/pkg/spec"
)

// Action is what the audit does about a pod whose redirect drifted (the agent's
// healing actions, pkg/heal).
type Action = heal.Action

// The actions.
const (
	ActionRepair = heal.Repair // re-apply the redirect in place
	ActionReport = heal.Report // Event, metric, log; nothing changed
	ActionEvict  = heal.Evict  // escaped pods only: evict, the controller recreates it
	// ActionDelete is the name "delete" is accepted under: evict.
	ActionDelete = heal.Evict
)

// ParseAction parses the drift action (repair or report).
func ParseAction(s string) (Action, error) {
	a, err := heal.ParseAction(s, ActionRepair, ActionReport)
	if err != nil {
		return "", fmt.Errorf("audit action: %w", err)
	}
	return a, nil
}

// ParseEscapedAction parses the escaped-pod action (repair, evict or report;
// delete is evict).
func ParseEscapedAction(s string) (Action, error) {
	a, err := heal.ParseAction(s, ActionRepair, ActionEvict, ActionReport)
	if err != nil {
		return "", fmt.Errorf("audit escaped-pod action: %w", err)
	}
	return a, nil
}

// Reasons of drift besides the engine's (engine.Reasons), as metric labels.
const (
	// ReasonNoRedirect: an escaped pod: no meshcni rule at all, no validation init
	// container.
	ReasonNoRedirect engine.Reason = "no-redirect"
	// ReasonAnnotationsChanged: the pod's annotations give another spec than the one
	// it was redirected with.
	ReasonAnnotationsChanged engine.Reason = "annotations-changed"
)

// MetricReasons lists every reason label of the drift metrics.
func MetricReasons() []engine.Reason {
	return append(append([]engine.Reason{}, engine.Reasons...), ReasonNoRedirect, ReasonAnnotationsChanged)
}

// Audited says whether the audit looks at pod, and why not. It looks at pods of
// node (any, when node is ""), running, not being deleted, not on the host network,
// with an IP, that the plugin redirects (capture.Decide with mesh: the pod's
// current annotations; the Auditor asks the sandbox's record first, Decided).
func Audited(pod *corev1.Pod, node string, mesh capture.Config) (bool, string) {
	if ok, why := eligible(pod, node); !ok {
		return false, why
	}
	if d := capture.Decide(k8spod.From(pod), mesh); !d.Captured() {
		return false, "not meshed: " + d.Reason
	}
	return true, ""
}

// eligible: Audited but the meshed decision.
func eligible(pod *corev1.Pod, node string) (bool, string) {
	switch {
	case pod == nil:
		return false, "no pod"
	case node != "" && pod.Spec.NodeName != node:
		return false, fmt.Sprintf("pod is on node %q, not %q", pod.Spec.NodeName, node)
	case pod.DeletionTimestamp != nil:
		return false, "pod is being deleted"
	case pod.Spec.HostNetwork:
		return false, "host network pod"
	case pod.Status.Phase != corev1.PodRunning:
		return false, fmt.Sprintf("pod is %s, not Running", pod.Status.Phase)
	case pod.Status.PodIP == "":
		return false, "pod has no IP yet"
	}
	return true, ""
}

// Decision is what the ADD of the pod's sandbox decided, as the agent recorded it.
type Decision = sandboxstate.Decision

// Verdict is how the audit treats a pod, from what its sandbox's ADD decided
// (recorded: "", none) and what its annotations say now (meshedNow).
type Verdict int

// The verdicts.
const (
	Skip   Verdict = iota // not audited
	Check                 // audited
	Change                // the annotations changed since the ADD: reported, never acted on
)

// Decided judges a pod by its ADD's decision: a pod ADD skipped is never
// audited (escaped or not), a pod ADD meshed is audited against its recorded
// redirect; when the annotations disagree with the ADD the change is reported and
// nothing is done. Without a record, the current annotations decide.
func Decided(recorded Decision, meshedNow bool) Verdict {
	switch {
	case recorded == sandboxstate.Skipped && meshedNow, recorded == sandboxstate.Meshed && !meshedNow:
		return Change
	case recorded == sandboxstate.Skipped, recorded == "" && !meshedNow:
		return Skip
	}
	return Check
}

// HasInitContainer reports whether pod declares an init container called name (the
// validation init container).
func HasInitContainer(pod *corev1.Pod, name string) bool {
	for _, c := range pod.Spec.InitContainers {
		if c.Name == name {
			return true
		}
	}
	return false
}

// Absent reports whether a report says the checked backend holds none of the pod's
// redirect: every difference is a missing chain or route, nothing unexpected.
func Absent(r engine.Report) bool {
	if len(r.Findings) == 0 || len(r.Unexpected) > 0 {
		return false
	}
	for _, f := range r.Findings {
		if f.Reason != engine.ReasonMissingChain && f.Reason != engine.ReasonMissingRoute {
			return false
		}
	}
	return true
}

// Hash identifies a spec: two specs with the same hash write the same redirect.
func Hash(s *spec.Spec) string {
	b, err := json.Marshal(s)
	if err != nil { // a spec is plain data; never happens
		return "unhashable: " + err.Error()
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:8])
}

// Judgement is what to do about one checked pod.
type Judgement struct {
	Drift   bool
	Escaped bool
	Action  Action
	Reasons []engine.Reason
}

// Judge decides from a drift report (absent: the namespace holds no meshcni rule in
// any backend; validation: the pod has a validation init container; recorded: its
// sandbox's ADD is recorded as meshed). Only a pod without a record can be
// escaped: a recorded ADD ran through meshcni, so missing rules are drift.
func Judge(r engine.Report, absent, validation, recorded bool, action, escaped Action) Judgement {
	if r.Empty() {
		return Judgement{}
	}
	j := Judgement{Drift: true, Action: action, Reasons: r.Reasons()}
	if absent && !validation && !recorded {
		j.Escaped, j.Action, j.Reasons = true, escaped, []engine.Reason{ReasonNoRedirect}
	}
	return j
}
