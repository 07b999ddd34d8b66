// Package repair is the node agent's repair controller: it finds the pods of its own
// node that Istio's validation init container (`istio-validation`, meshcni's
// `meshcnictl validate`) reported as unredirected — they started before meshcni was
// in the node's CNI chain — and fixes them, by one of three actions:
//
//   - repair (in place): find the pod's network namespace on the host (pkg/podnetns;
//     none when several hold the pod's addresses), hold it open and apply the pod's
//     redirect there (pkg/capture, pkg/engine), so the next restart of the init
//     container passes; nothing is deleted;
//   - evict (opt-in): evict the pod (pkg/heal: the Eviction API with UID and
//     resourceVersion preconditions, PodDisruptionBudgets, never a bare or mirror
//     pod, the node's budget and circuit breaker) so its controller recreates it,
//     this time through meshcni's plugin;
//   - label: label the pod (cni.istio.io/uninitialized=true) for operators.
//
// The decision (Decide) is pure; the Controller runs it over the node's pod cache
// through a rate-limited work queue, acts at most once per pod UID (per failed run
// of the init container for the in-place repair), and reports every action as a
// Kubernetes Event on the pod, a metric and one log line.
package repair

import (
	"fmt"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/capture/k8spod"
	"github.com/meshcni/meshcni/pkg/heal"
)

// Action is what the controller does to a broken pod (the agent's healing
// actions, pkg/heal).
type Action = heal.Action

// The actions, in order of preference: repair in place first, delete, label last.
const (
	ActionRepair = heal.Repair
	ActionEvict  = heal.Evict
	ActionLabel  = heal.Label
	// ActionDelete is the name "delete" is accepted under: evict.
	ActionDelete = heal.Evict
)

// Actions lists the valid actions.
var Actions = []Action{ActionRepair, ActionEvict, ActionLabel}

// ParseAction parses an action name (delete is evict).
func ParseAction(s string) (Action, error) {
	a, err := heal.ParseAction(s, Actions...)
	if err != nil {
		return "", fmt.Errorf("repair action: %w", err)
	}
	return a, nil
}

// Defaults of the settings (Istio's names and exit code).
const (
	DefaultLabelKey      = "cni.istio.io/uninitialized"
	LabelValue           = "true"
	DefaultInitContainer = "istio-validation"
	DefaultExitCode      = 126
)

// Criteria say when a pod is broken.
type Criteria struct {
	// InitContainer is the validation init container's name.
	InitContainer string
	// ExitCode is the exit code that means "the redirect is missing".
	ExitCode int32
	// Message, when set, must match the failed run's termination message.
	Message *regexp.Regexp
}

// Failure is one failed run of the validation init container.
type Failure struct {
	Container   string
	ContainerID string // of the failed run ("" when the runtime gave none)
	ExitCode    int32
	Message     string
	StartedAt   time.Time
	FinishedAt  time.Time
	Restarts    int32
}

// Broken reports the pod's failure when it is broken: it carries
// sidecar.istio.io/status, is not being deleted, its validation init container has
// not completed (no run exited 0) and that container's last termination (current
// state, else last state) exited with ExitCode (and its message matches Message,
// when set). Otherwise the failure is nil and reason says why the pod is not broken.
func (c Criteria) Broken(pod *corev1.Pod) (*Failure, string) {
	if pod == nil {
		return nil, "no pod"
	}
	if pod.DeletionTimestamp != nil {
		return nil, "pod is being deleted"
	}
	if _, ok := pod.Annotations[capture.AnnotationStatus]; !ok {
		return nil, "no " + capture.AnnotationStatus + " annotation (no Istio sidecar)"
	}
	var st *corev1.ContainerStatus
	for i := range pod.Status.InitContainerStatuses {
		if pod.Status.InitContainerStatuses[i].Name == c.InitContainer {
			st = &pod.Status.InitContainerStatuses[i]
			break
		}
	}
	if st == nil {
		return nil, fmt.Sprintf("no status of an init container %s", c.InitContainer)
	}
	if t := st.State.Terminated; t != nil && t.ExitCode == 0 {
		return nil, fmt.Sprintf("init container %s completed", c.InitContainer)
	}
	last := st.State.Terminated
	if last == nil {
		last = st.LastTerminationState.Terminated
	}
	if last == nil {
		return nil, fmt.Sprintf("init container %s has not failed", c.InitContainer)
	}
	if last.ExitCode != c.ExitCode {
		return nil, fmt.Sprintf("init container %s last exited %d, not %d", c.InitContainer, last.ExitCode, c.ExitCode)
	}
	if c.Message != nil && !c.Message.MatchString(last.Message) {
		return nil, fmt.Sprintf("init container %s's termination message %q does not match %q", c.InitContainer, last.Message, c.Message)
	}
	return &Failure{
		Container:   c.InitContainer,
		ContainerID: last.ContainerID,
		ExitCode:    last.ExitCode,
		Message:     last.Message,
		StartedAt:   last.StartedAt.Time,
		FinishedAt:  last.FinishedAt.Time,
		Restarts:    st.RestartCount,
	}, ""
}

// Policy is everything Decide needs besides the pod.
type Policy struct {
	// Node is this agent's node: pods of other nodes are never acted on.
	Node     string
	Action   Action
	Criteria Criteria
	// Mesh decides whether a pod is meshed (the agent's excluded namespaces).
	Mesh capture.Config
	// LabelKey is the label the label action sets (to LabelValue).
	LabelKey string
	// LabelSelector and FieldSelector narrow the pods considered (nil: all).
	LabelSelector labels.Selector
	FieldSelector fields.Selector
}

// Decision is what to do with one pod.
type Decision struct {
	Act     bool
	Action  Action
	Failure *Failure
	// Key identifies the action for "at most once": the pod UID, plus the failed
	// run's container ID for the in-place repair (a pod whose init container fails
	// again in a run started after the repair is repaired again, once per failed
	// run, at most MaxRepairsPerPod times).
	Key string
	// Reason says why nothing is done (when !Act) or why the pod is broken.
	Reason string
}

func skip(format string, args ...any) Decision {
	return Decision{Reason: fmt.Sprintf(format, args...)}
}

// Decide says whether and how to act on pod. It never acts on a pod of another
// node, a pod the selectors leave out, a pod that is not broken (Criteria.Broken),
// a pod meshcni does not redirect (capture.Decide: not meshed, excluded namespace,
// host network), a pod already labelled (label), or a pod whose init container will
// not run again (repair: phase Failed or Succeeded).
func Decide(pod *corev1.Pod, p Policy) Decision {
	if pod == nil {
		return skip("no pod")
	}
	if p.Node != "" && pod.Spec.NodeName != p.Node {
		return skip("pod is on node %q, not %q", pod.Spec.NodeName, p.Node)
	}
	if p.LabelSelector != nil && !p.LabelSelector.Matches(labels.Set(pod.Labels)) {
		return skip("labels not selected by %q", p.LabelSelector)
	}
	if p.FieldSelector != nil && !p.FieldSelector.Matches(PodFields(pod)) {
		return skip("fields not selected by %q", p.FieldSelector)
	}
	f, why := p.Criteria.Broken(pod)
	if f == nil {
		return skip("not broken: %s", why)
	}
	if d := capture.Decide(k8spod.From(pod), p.Mesh); !d.Captured() {
		return skip("not meshed: %s", d.Reason)
	}
	if pod.Spec.HostNetwork {
		return skip("host network pod: meshcni never redirects the host's namespace")
	}
	key := string(pod.UID)
	switch p.Action {
	case ActionRepair:
		if pod.Status.Phase == corev1.PodFailed || pod.Status.Phase == corev1.PodSucceeded {
			return skip("pod is %s: its init container will not run again (the evict action recreates controlled pods)", pod.Status.Phase)
		}
		run := f.ContainerID
		if run == "" {
			run = strconv.FormatInt(f.FinishedAt.UnixNano(), 10)
		}
		key += "/" + run
	case ActionLabel:
		if pod.Labels[p.LabelKey] == LabelValue {
			return skip("already labelled %s=%s", p.LabelKey, LabelValue)
		}
	case ActionEvict:
	default:
		return skip("unknown action %q", p.Action)
	}
	return Decision{
		Act: true, Action: p.Action, Failure: f, Key: key,
		Reason: fmt.Sprintf("init container %s exited %d (restarts %d): the traffic redirect is missing", f.Container, f.ExitCode, f.Restarts),
	}
}

// PodFields are the fields of a pod a field selector can use, as the API server
// offers them for pods.
func PodFields(pod *corev1.Pod) fields.Set {
	return fields.Set{
		"metadata.name":            pod.Name,
		"metadata.namespace":       pod.Namespace,
		"spec.nodeName":            pod.Spec.NodeName,
		"spec.restartPolicy":       string(pod.Spec.RestartPolicy),
		"spec.schedulerName":       pod.Spec.SchedulerName,
		"spec.serviceAccountName":  pod.Spec.ServiceAccountName,
		"spec.hostNetwork":         strconv.FormatBool(pod.Spec.HostNetwork),
		"status.phase":             string(pod.Status.Phase),
		"status.podIP":             pod.Status.PodIP,
		"status.nominatedNodeName": pod.Status.NominatedNodeName,
	}
}

// ParseLabelKey checks a label key (a qualified name, optionally prefixed).
func ParseLabelKey(s string) (string, error) {
	if errs := validation.IsQualifiedName(s); len(errs) > 0 {
		return "", fmt.Errorf("label key %q: %s", s, strings.Join(errs, "; "))
	}
	return s, nil
}

// ParseLabelSelector parses a label selector ("" selects every pod: nil).
func ParseLabelSelector(s string) (labels.Selector, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	sel, err := labels.Parse(s)
	if err != nil {
		return nil, fmt.Errorf("label selector %q: %w", s, err)
	}
	return sel, nil
}

// ParseFieldSelector parses a pod field selector ("": nil); only the fields of
// PodFields are accepted.
func ParseFieldSelector(s string) (fields.Selector, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	sel, err := fields.ParseSelector(s)
	if err != nil {
		return nil, fmt.Errorf("field selector %q: %w", s, err)
	}
	known := PodFields(&corev1.Pod{})
	for _, r := range sel.Requirements() {
		if _, ok := known[r.Field]; !ok {
			return nil, fmt.Errorf("field selector %q: field %q is not a pod field (want one of %s)", s, r.Field, strings.Join(sortedKeys(known), ", "))
		}
	}
	return sel, nil
}

// ParseMessage compiles the termination message pattern ("": nil, any message).
func ParseMessage(s string) (*regexp.Regexp, error) {
	if s == "" {
		return nil, nil
	}
	re, err := regexp.Compile(s)
	if err != nil {
		return nil, fmt.Errorf("message pattern %q: %w", s, err)
	}
	return re, nil
}

// ParseExitCode checks an exit code (1-255: 0 is success).
func ParseExitCode(n int) (int32, error) {
	if n < 1 || n > 255 {
		return 0, fmt.Errorf("exit code %d: want 1 to 255", n)
	}
	return int32(n), nil
}

// ParseInitContainer checks a container name (a DNS label).
func ParseInitContainer(s string) (string, error) {
	if errs := validation.IsDNS1123Label(s); len(errs) > 0 {
		return "", fmt.Errorf("init container name %q: %s", s, strings.Join(errs, "; "))
	}
	return s, nil
}

func sortedKeys(s fields.Set) []string {
	out := make([]string, 0, len(s))
	for k := range s {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
