package audit

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/record"

	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/engine"
	"github.com/meshcni/meshcni/pkg/heal"
	"github.com/meshcni/meshcni/pkg/podnetns"
	"github.com/meshcni/meshcni/pkg/spec"
)

// Event reasons on the pods audited (all Warning: each says the redirect was, or
// is, not what it should be).
const (
	EventDrift              = "MeshcniRedirectDrift"      // drift found (and repaired, or only reported)
	EventEscaped            = "MeshcniEscapedPod"         // no redirect, no validation init container
	EventAnnotationsChanged = "MeshcniAnnotationsChanged" // annotations changed on a running pod
	EventFailed             = "MeshcniAuditActionFailed"  // the action failed
	EventRefused            = "MeshcniSandboxUnverified"  // the pod's netns could not be verified: nothing done
)

// Log messages (one line per finding).
const (
	LogStarted  = "audit started"
	LogDrift    = "audit: redirect drift"
	LogEscaped  = "audit: pod escaped the redirect"
	LogChanged  = "audit: pod annotations changed"
	LogFailed   = "audit: action failed"
	LogGone     = "audit: pod network namespace gone, dropped until its containers start again"
	LogError    = "audit: check failed"
	LogRefused  = "audit: the pod's network namespace is not verified to be its sandbox's: nothing done"
	LogRound    = "audit round"
	defaultConc = 4
)

// Defaults of the settings.
const (
	DefaultPeriod      = 60 * time.Second
	DefaultConcurrency = 4
	// Jitter is the fraction by which a period varies, each way.
	Jitter = 0.1
	// Spread is the fraction of the period a round's pods are spread over.
	Spread = 0.75
)

// Pods is the node's pod cache (pkg/agent/nodepods.Cache).
type Pods interface {
	List() []*corev1.Pod
	Get(namespace, name string) (*corev1.Pod, bool)
}

// Netns finds a pod's network namespace by its sandbox and holds it open
// (podnetns.Locator: the recorded netns, verified, else the one of the pod's
// cgroup, cross-checked; never by an IP alone).
type Netns interface {
	Locate(ctx context.Context, pod *corev1.Pod) (*podnetns.Handle, error)
}

// The effects, replaceable in tests (defaults: the engine's).
type (
	CheckFunc func(ctx context.Context, o engine.Options, s *spec.Spec) (engine.Report, error)
	ApplyFunc func(ctx context.Context, o engine.Options, s *spec.Spec) (backend.Kind, error)
	LiveFunc  func(ctx context.Context, o engine.Options) (map[backend.Kind]string, error)
)

// AppliedSpecs is what the agent remembers of the spec each pod was redirected
// with, beyond one auditor's life.
type AppliedSpecs interface {
	// Applied returns the spec pod was redirected with (false: unknown). The
	// auditor keeps what it gets.
	Applied(pod *corev1.Pod) (*spec.Spec, bool)
	// Remember records the spec the audit found pod redirected with, or applied.
	Remember(pod *corev1.Pod, s *spec.Spec)
}

// Decisions is what the agent recorded of each pod's sandbox's ADD (pkg/agent's
// Sandboxes): the decision of the pod's newest recorded sandbox and its reason
// ("": no record says).
type Decisions interface {
	Decided(pod *corev1.Pod) (Decision, string)
}

// Metrics are the audit's counters.
type Metrics struct {
	Detected *prometheus.CounterVec // meshcni_drift_detected_total{reason}
	Repaired *prometheus.CounterVec // meshcni_drift_repaired_total{reason}
	Errors   *prometheus.CounterVec // meshcni_audit_errors_total{stage}
	Rounds   prometheus.Counter     // meshcni_audit_rounds_total
	Refused  *prometheus.CounterVec // meshcni_audit_refused_total{reason}
}

// Refusal reasons (the Refused metric's labels): why a pod's netns was not acted on.
const (
	RefusedGone      = "netns-gone"      // the recorded netns no longer exists
	RefusedMismatch  = "netns-mismatch"  // another netns than the recorded, or recorded for another sandbox
	RefusedAmbiguous = "netns-ambiguous" // the pod's processes run in several netns
)

// refusal is the Refused label of a Locate error ("": not a refusal).
func refusal(err error) string {
	switch {
	case errors.Is(err, podnetns.ErrGone):
		return RefusedGone
	case errors.Is(err, podnetns.ErrMismatch):
		return RefusedMismatch
	case errors.Is(err, podnetns.ErrAmbiguous):
		return RefusedAmbiguous
	}
	return ""
}

// NewMetrics creates the metrics and registers them in reg (when not nil).
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		Detected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshcni_drift_detected_total",
			Help: "Differences the audit found between a meshed pod's live redirect and its spec, by reason (one per pod and reason each time it appears).",
		}, []string{"reason"}),
		Repaired: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshcni_drift_repaired_total",
			Help: "Drift the audit handled by acting: the redirect re-applied in place, or an escaped pod deleted for its controller to recreate, by reason.",
		}, []string{"reason"}),
		Errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshcni_audit_errors_total",
			Help: "Audit failures by stage (spec, netns, check, action).",
		}, []string{"stage"}),
		Rounds: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "meshcni_audit_rounds_total",
			Help: "Audit rounds over the node's meshed pods.",
		}),
		Refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshcni_audit_refused_total",
			Help: "Pods the audit left alone because their network namespace was not verified to be their sandbox's, by reason (netns-gone, netns-mismatch, netns-ambiguous).",
		}, []string{"reason"}),
	}
	for _, r := range []string{RefusedGone, RefusedMismatch, RefusedAmbiguous} {
		m.Refused.WithLabelValues(r)
	}
	for _, r := range MetricReasons() {
		m.Detected.WithLabelValues(string(r))
		m.Repaired.WithLabelValues(string(r))
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{m.Detected, m.Repaired, m.Errors, m.Rounds, m.Refused} {
			if err := reg.Register(c); err != nil {
				return nil, fmt.Errorf("register audit metrics: %w", err)
			}
		}
	}
	return m, nil
}

// Options configure an Auditor.
type Options struct {
	// Node is this agent's node ("": every pod Pods lists).
	Node string
	// Mesh decides which pods are meshed (the agent's excluded namespaces, IPv6 mode).
	Mesh capture.Config
	// Backend is the engine backend (the agent's --backend).
	Backend backend.Kind
	// Period between rounds (jittered by ±Jitter); 0: one round at start only, then
	// only pods whose containers start.
	Period time.Duration
	// Concurrency bounds the pods checked at a time (default DefaultConcurrency).
	Concurrency int
	// Action on drift (default repair); EscapedAction on escaped pods (default repair).
	Action, EscapedAction Action
	// FollowAnnotations applies a changed spec instead of reporting it.
	FollowAnnotations bool
	// InitContainer is the validation init container's name (istio-validation).
	InitContainer string
	// Applied, when set, remembers across the agent's restarts the spec each pod
	// was redirected with (the agent's sandbox state, recorded at the sandbox's
	// ADD): a pod this auditor has not seen yet is checked against it, and a
	// change of its annotations since is reported, instead of the annotations
	// being taken as the spec it was redirected with.
	Applied AppliedSpecs
	// Decisions, when set, say what each pod's sandbox's ADD decided: a pod ADD
	// skipped is never audited nor escaped, and annotations that disagree with the
	// ADD are reported, never acted on (Decided).
	Decisions Decisions

	Pods   Pods
	Netns  Netns
	Client kubernetes.Interface // unused by the audit itself (the Evictor has its own)
	// Evictor evicts escaped pods (EscapedAction evict); nil: evict fails.
	Evictor *heal.Evictor
	Events  record.EventRecorder
	// ReadyToDelete, when set, must return nil before a pod is evicted (the plugin
	// installed, so the recreated pod gets its redirect).
	ReadyToDelete func() error
	Metrics       *Metrics
	Log           *slog.Logger

	Check CheckFunc
	Apply ApplyFunc
	Live  LiveFunc
}

// Auditor audits the node's meshed pods.
type Auditor struct {
	o       Options
	mu      sync.Mutex
	pods    map[types.UID]*podState
	trigger chan string
	sem     chan struct{} // Concurrency slots, shared by rounds and triggers
}

// podState is what the audit knows of one pod (by UID).
type podState struct {
	busy sync.Mutex
	// spec and hash: the redirect the pod was last seen with, or repaired to.
	spec *spec.Spec
	hash string
	// path and id: where the pod's namespace was located, and its identity with
	// its cookie (never reused): reopened by path while it is that namespace.
	path string
	id   podnetns.Identity
	// kind: the backend found holding the pod's redirect (checked without probing).
	kind backend.Kind
	// gone: the namespace was not found; skipped until the containers start again.
	gone bool
	// recorded: the pod's sandbox's ADD is recorded as meshed.
	recorded bool
	// reported: the last finding reported (report mode: not repeated each round);
	// changed: the annotations' spec hash last reported as changed; lastErr: the
	// last error logged at Warn level.
	reported, changed, lastErr string
}

// New checks the options and returns an Auditor.
func New(o Options) (*Auditor, error) {
	if o.Pods == nil || o.Events == nil {
		return nil, errors.New("audit: the node's pods and an Event recorder are needed")
	}
	if o.Action == "" {
		o.Action = ActionRepair
	}
	if o.EscapedAction == "" {
		o.EscapedAction = ActionRepair
	}
	if _, err := ParseAction(string(o.Action)); err != nil {
		return nil, err
	}
	if _, err := ParseEscapedAction(string(o.EscapedAction)); err != nil {
		return nil, err
	}
	if o.Period < 0 {
		return nil, fmt.Errorf("audit: period %v: want 0 (off) or more", o.Period)
	}
	if o.Concurrency <= 0 {
		o.Concurrency = defaultConc
	}
	if o.InitContainer == "" {
		o.InitContainer = "istio-validation"
	}
	if o.Netns == nil {
		o.Netns = &podnetns.Locator{}
	}
	if o.Check == nil {
		o.Check = engine.CheckReport
	}
	if o.Apply == nil {
		o.Apply = engine.Apply
	}
	if o.Live == nil {
		o.Live = engine.Live
	}
	if o.Log == nil {
		o.Log = slog.Default()
	}
	if o.Metrics == nil {
		m, err := NewMetrics(nil)
		if err != nil {
			return nil, err
		}
		o.Metrics = m
	}
	return &Auditor{o: o, pods: map[types.UID]*podState{}, trigger: make(chan string, 1024), sem: make(chan struct{}, o.Concurrency)}, nil
}

// Name implements the agent's Runnable.
func (a *Auditor) Name() string { return "audit" }

// Tracked is the number of pods the auditor remembers (it must not outgrow the
// node's pods).
func (a *Auditor) Tracked() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.pods)
}

// state returns the pod's record, creating it.
func (a *Auditor) state(uid types.UID) *podState {
	a.mu.Lock()
	defer a.mu.Unlock()
	st := a.pods[uid]
	if st == nil {
		st = &podState{}
		a.pods[uid] = st
	}
	return st
}

// Forget drops what the auditor knows of a deleted pod.
func (a *Auditor) Forget(pod *corev1.Pod) {
	a.mu.Lock()
	delete(a.pods, pod.UID)
	a.mu.Unlock()
}

// ContainersStarted tells the auditor that a pod's containers started (the
// informer's update): the pod is checked soon, also when its namespace was gone.
func (a *Auditor) ContainersStarted(pod *corev1.Pod) {
	a.mu.Lock()
	if st := a.pods[pod.UID]; st != nil {
		st.gone = false
		st.path = ""
	}
	a.mu.Unlock()
	select {
	case a.trigger <- pod.Namespace + "/" + pod.Name:
	default: // full: the next round checks it
	}
}

// prune drops the records of pods no longer listed.
func (a *Auditor) prune(pods []*corev1.Pod) {
	live := make(map[types.UID]bool, len(pods))
	for _, p := range pods {
		live[p.UID] = true
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	for uid := range a.pods {
		if !live[uid] {
			delete(a.pods, uid)
		}
	}
}

// StartedContainers reports whether an update started a container: one is running
// in cur that was not (or ran with another ID) in old.
func StartedContainers(old, cur *corev1.Pod) bool {
	if cur == nil || cur.Status.Phase != corev1.PodRunning {
		return false
	}
	was := map[string]string{}
	if old != nil {
		for _, s := range old.Status.ContainerStatuses {
			if s.State.Running != nil {
				was[s.Name] = s.ContainerID
			}
		}
	}
	for _, s := range cur.Status.ContainerStatuses {
		if s.State.Running == nil {
			continue
		}
		if id, ok := was[s.Name]; !ok || id != s.ContainerID {
			return true
		}
	}
	return false
}
