// Package audit is the node agent's self-healing: it compares the live redirect in
// the network namespace of every meshed pod of its node with the spec the pod's
// annotations give (engine.CheckReport), at start, when a pod's containers start and
// periodically, and handles drift by the configured action:
//
//   - repair (default): re-apply the pod's redirect atomically, in place;
//   - report: change nothing; the Event, the metric and the log line say what changed;
//   - delete (escaped pods only, their default): a pod with no meshcni redirect at
//     all and no validation init container — its sandbox was created while meshcni
//     was not in the CNI chain — is deleted so its controller recreates it through
//     the chain.
//
// Pods the plugin deliberately skips (capture.Decide) are never touched. The spec a
// pod was redirected with is remembered (first audit, or the last repair; across
// the agent's restarts through Options.Applied, which the agent fills at the
// sandbox's ADD): a later change of its annotations is reported, not applied
// (Istio re-reads none), unless FollowAnnotations is set.
//
// Cost is bounded: a round enters each pod's namespace once (the namespace is found
// once, then reopened by the path it was found through), rounds are spread over the
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
	"strings"

	corev1 "k8s.io/api/core/v1"

	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/capture/k8spod"
	"github.com/meshcni/meshcni/pkg/engine"
	"github.com/meshcni/meshcni/pkg/spec"
)

// Action is what the audit does about a pod whose redirect drifted.
type Action string

// The actions.
const (
	ActionRepair Action = "repair" // re-apply the redirect in place
	ActionReport Action = "report" // Event, metric, log; nothing changed
	ActionDelete Action = "delete" // escaped pods only: delete, the controller recreates it
)

// ParseAction parses the drift action (repair or report).
func ParseAction(s string) (Action, error) {
	switch a := Action(strings.TrimSpace(s)); a {
	case ActionRepair, ActionReport:
		return a, nil
	}
	return "", fmt.Errorf("unknown audit action %q: want repair or report", s)
}

// ParseEscapedAction parses the escaped-pod action (delete, repair or report).
func ParseEscapedAction(s string) (Action, error) {
	switch a := Action(strings.TrimSpace(s)); a {
	case ActionDelete, ActionRepair, ActionReport:
		return a, nil
	}
	return "", fmt.Errorf("unknown audit escaped-pod action %q: want delete, repair or report", s)
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
// with an IP, that the plugin redirects (capture.Decide with mesh).
func Audited(pod *corev1.Pod, node string, mesh capture.Config) (bool, string) {
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
	if d := capture.Decide(k8spod.From(pod), mesh); !d.Captured() {
		return false, "not meshed: " + d.Reason
	}
	return true, ""
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
// any backend; validation: the pod has a validation init container).
func Judge(r engine.Report, absent, validation bool, action, escaped Action) Judgement {
	if r.Empty() {
		return Judgement{}
	}
	j := Judgement{Drift: true, Action: action, Reasons: r.Reasons()}
	if absent && !validation {
		j.Escaped, j.Action, j.Reasons = true, escaped, []engine.Reason{ReasonNoRedirect}
	}
	return j
}
