package heal

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// Why an eviction was refused (the refusal metric's labels).
const (
	RefusedNoController = "no-controller" // a bare pod: never evicted
	RefusedMirror       = "mirror-pod"    // a static pod's mirror: never evicted
	RefusedBreaker      = "breaker-open"  // the node's budget is spent
	RefusedOwnerRepeats = "owner-repeats" // the workload escaped again after its replacement
	RefusedDisruption   = "disruption-budget"
	RefusedForbidden    = "forbidden"
)

// RefusedReasons lists the refusal labels.
var RefusedReasons = []string{RefusedNoController, RefusedMirror, RefusedBreaker, RefusedOwnerRepeats, RefusedDisruption, RefusedForbidden}

// Event reasons.
const (
	EventNotEvicted  = "MeshcniNotEvicted"       // Warning on the pod: a guard left it alone
	EventBreakerOpen = "MeshcniEvictionsStopped" // Warning on the agent's Pod, once
	// LogRefused and LogTripped are the log lines of a refusal and of the breaker opening.
	LogRefused = "heal: eviction refused, pod left alone"
	LogTripped = "heal: eviction budget spent, circuit breaker open: no more evictions until the agent restarts"
)

// MirrorAnnotation marks a static pod's mirror.
const MirrorAnnotation = "kubernetes.io/config.mirror"

// Refused is an eviction a guard did not let happen: the pod is left alone and
// reported; not an error to retry.
type Refused struct {
	Reason string
	Err    error
}

func (r *Refused) Error() string { return r.Err.Error() }
func (r *Refused) Unwrap() error { return r.Err }

// IsRefused says whether err is a Refused, and returns it.
func IsRefused(err error) (*Refused, bool) {
	var r *Refused
	ok := errors.As(err, &r)
	return r, ok
}

// Metrics are the eviction counters and the breaker gauge.
type Metrics struct {
	Evictions prometheus.Counter     // meshcni_heal_evictions_total
	Refusals  *prometheus.CounterVec // meshcni_heal_eviction_refusals_total{reason}
	Breaker   prometheus.Gauge       // meshcni_heal_breaker_open
}

// NewMetrics creates the metrics and registers them in reg (when not nil).
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		Evictions: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "meshcni_heal_evictions_total",
			Help: "Pods the agent evicted through the Eviction API (escaped, or their validation failed) for their controller to recreate.",
		}),
		Refusals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshcni_heal_eviction_refusals_total",
			Help: "Evictions refused, the pod left alone, by reason (no-controller, mirror-pod, breaker-open, owner-repeats, disruption-budget, forbidden).",
		}, []string{"reason"}),
		Breaker: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "meshcni_heal_breaker_open",
			Help: "1 when the node's eviction budget is spent and the agent evicts nothing more until it restarts.",
		}),
	}
	for _, r := range RefusedReasons {
		m.Refusals.WithLabelValues(r)
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{m.Evictions, m.Refusals, m.Breaker} {
			if err := reg.Register(c); err != nil {
				return nil, fmt.Errorf("register heal metrics: %w", err)
			}
		}
	}
	return m, nil
}

// Warner reports on the agent's own Pod (pkg/agent's Recorder).
type Warner interface {
	Warning(reason, message string)
}

// Evictor is the one eviction path of the agent.
type Evictor struct {
	Client kubernetes.Interface
	Budget *Budget
	// Meshed counts the node's meshed pods (the fraction's base).
	Meshed func() int
	// Agent, when set, gets the Warning when the breaker opens.
	Agent   Warner
	Metrics *Metrics
	Log     *slog.Logger
	Now     func() time.Time
}

// Evict evicts the pod through the Eviction API (UID and resourceVersion
// preconditions) when every guard allows it. A *Refused error: the pod was left
// alone (logged, counted); a conflict or another error: not evicted, try again.
func (e *Evictor) Evict(ctx context.Context, pod *corev1.Pod) error {
	if e.Client == nil {
		return errors.New("not evicting: no Kubernetes API access")
	}
	if r := e.guard(pod); r != nil {
		return e.refuse(pod, r)
	}
	owner := Owner(pod)
	now := time.Now()
	if e.Now != nil {
		now = e.Now()
	}
	meshed := 0
	if e.Meshed != nil {
		meshed = e.Meshed()
	}
	switch v, why := e.Budget.Take(now, owner, pod.CreationTimestamp.Time, meshed); v {
	case Tripped:
		e.Metrics.Breaker.Set(1)
		e.Log.Error(LogTripped, "why", why, "pod_namespace", pod.Namespace, "pod_name", pod.Name)
		if e.Agent != nil {
			e.Agent.Warning(EventBreakerOpen, "meshcni: "+why)
		}
		return e.refuse(pod, &Refused{RefusedBreaker, errors.New(why)})
	case BreakerOpen:
		return e.refuse(pod, &Refused{RefusedBreaker, errors.New(why)})
	case OwnerRepeats:
		return e.refuse(pod, &Refused{RefusedOwnerRepeats, errors.New(why)})
	}
	err := e.evict(ctx, pod)
	if err != nil {
		e.Budget.Refund(owner)
		if r, ok := IsRefused(err); ok {
			return e.refuse(pod, r)
		}
		return err
	}
	e.Metrics.Evictions.Inc()
	return nil
}

// guard refuses a bare pod and a mirror pod.
func (e *Evictor) guard(pod *corev1.Pod) *Refused {
	if _, ok := pod.Annotations[MirrorAnnotation]; ok {
		return &Refused{RefusedMirror, fmt.Errorf("pod %s/%s is a static pod's mirror: never evicted (fix its manifest on the node)", pod.Namespace, pod.Name)}
	}
	if metav1.GetControllerOf(pod) == nil {
		return &Refused{RefusedNoController, fmt.Errorf("pod %s/%s has no controller owner: never evicted (nothing would recreate it; recreate it yourself)", pod.Namespace, pod.Name)}
	}
	return nil
}

// evict calls the Eviction API.
func (e *Evictor) evict(ctx context.Context, pod *corev1.Pod) error {
	uid, rv := pod.UID, pod.ResourceVersion
	ev := &policyv1.Eviction{
		ObjectMeta:    metav1.ObjectMeta{Namespace: pod.Namespace, Name: pod.Name},
		DeleteOptions: &metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &uid, ResourceVersion: &rv}},
	}
	err := e.Client.PolicyV1().Evictions(pod.Namespace).Evict(ctx, ev)
	switch {
	case err == nil, apierrors.IsNotFound(err):
		return nil
	case apierrors.IsTooManyRequests(err):
		return &Refused{RefusedDisruption, fmt.Errorf("the API server refused the eviction of %s/%s (429: a PodDisruptionBudget allows no disruption now): %w", pod.Namespace, pod.Name, err)}
	case apierrors.IsForbidden(err):
		return &Refused{RefusedForbidden, fmt.Errorf("the API server forbade the eviction of %s/%s (403: the agent's role or an admission policy): %w", pod.Namespace, pod.Name, err)}
	}
	return fmt.Errorf("evict: %w", err)
}

func (e *Evictor) refuse(pod *corev1.Pod, r *Refused) error {
	e.Metrics.Refusals.WithLabelValues(r.Reason).Inc()
	e.Log.Warn(LogRefused, "reason", r.Reason, "pod_namespace", pod.Namespace, "pod_name", pod.Name, "err", r.Err)
	return r
}

// Owner names the pod's workload: its controller's kind, namespace and name
// (the pod itself without one).
func Owner(pod *corev1.Pod) string {
	if c := metav1.GetControllerOf(pod); c != nil {
		return c.Kind + "/" + pod.Namespace + "/" + c.Name
	}
	return "Pod/" + pod.Namespace + "/" + pod.Name
}
