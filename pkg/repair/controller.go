package repair

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/time/rate"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"

	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/capture/k8spod"
	"github.com/meshcni/meshcni/pkg/engine"
	"github.com/meshcni/meshcni/pkg/heal"
	"github.com/meshcni/meshcni/pkg/podnetns"
	"github.com/meshcni/meshcni/pkg/sandboxstate"
	"github.com/meshcni/meshcni/pkg/spec"
)

// Event reasons on the pods acted on.
const (
	ReasonRepaired = "MeshcniRedirectRepaired"    // Normal: rules applied in place
	ReasonDeleted  = "MeshcniEvictedUnredirected" // Normal: pod evicted for its controller to recreate
	ReasonLabeled  = "MeshcniLabeledUnredirected" // Normal: label set
	ReasonFailed   = "MeshcniRepairFailed"        // Warning: the action failed
	ReasonGaveUp   = "MeshcniRepairGaveUp"        // Warning: the action failed MaxAttempts times
	ReasonRefused  = "MeshcniSandboxUnverified"   // Warning: the pod's netns or decision forbids acting: nothing done
	resultSuccess  = "success"
	resultError    = "error"
	resultRefused  = "refused"
	defaultWorkers = 4
	// MaxRepairsPerPod bounds the in-place repairs of one pod: a pod whose validation
	// still fails after that many is failing for another reason.
	MaxRepairsPerPod = 3
	// retryAfter spaces retries of transient conditions (errRetry).
	retryAfter = 100 * time.Millisecond
)

// NewRateLimiter spaces the attempts of a failing action: 250 ms doubling up to 30 s
// per pod, and at most 10 actions per second (burst 100) overall.
func NewRateLimiter() workqueue.TypedRateLimiter[string] {
	return workqueue.NewTypedMaxOfRateLimiter(
		workqueue.NewTypedItemExponentialFailureRateLimiter[string](250*time.Millisecond, 30*time.Second),
		&workqueue.TypedBucketRateLimiter[string]{Limiter: rate.NewLimiter(rate.Limit(10), 100)},
	)
}

// Log messages of the controller's notable records (one line per action).
const (
	LogWatching  = "repair controller watching the node's pods" // cache synced, workers started
	LogSucceeded = "repair action succeeded"
	LogFailed    = "repair action failed, will retry"
	LogGaveUp    = "repair action failed, giving up"
	LogRefused   = "repair refused: nothing done to the pod"
	// Debug records: the controller looked at a pod and leaves it alone (for now).
	LogNotBroken   = "repair: pod not broken" // the cheap test on every add/update
	LogNothingToDo = "repair: nothing to do"  // Decide on a queued pod, or its failed run was handled
	LogRetryLater  = "repair: retry later"    // a transient condition (stale pod, plugin not installed)
)

// Pods is the node's pod cache (pkg/agent/nodepods.Cache).
type Pods interface {
	Informer() cache.SharedIndexInformer
	Get(namespace, name string) (*corev1.Pod, bool)
	WaitForSync(ctx context.Context) bool
}

// Netns finds a pod's network namespace by its sandbox and holds it open
// (podnetns.Locator: the recorded netns, verified, else the one of the pod's
// cgroup, cross-checked; never by an IP alone).
type Netns interface {
	Locate(ctx context.Context, pod *corev1.Pod) (*podnetns.Handle, error)
}

// Decisions is what the agent recorded of each pod's sandbox's ADD (pkg/agent's
// Sandboxes): the decision of the pod's newest recorded sandbox and its reason
// ("": no record says).
type Decisions interface {
	Decided(pod *corev1.Pod) (sandboxstate.Decision, string)
}

// ApplyFunc writes a pod's redirect (engine.Apply).
type ApplyFunc func(ctx context.Context, o engine.Options, s *spec.Spec) (backend.Kind, error)

// Metrics holds meshcni_repairs_total.
type Metrics struct {
	Repairs *prometheus.CounterVec
}

// NewMetrics creates the repair metrics and registers them in reg (when not nil).
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{Repairs: prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "meshcni_repairs_total",
		Help: "Actions of the repair controller on pods whose validation init container found no redirect, by action (repair, evict, label) and result (success, error, refused: the pod's network namespace not verified to be its sandbox's, nothing done).",
	}, []string{"action", "result"})}
	if reg != nil {
		if err := reg.Register(m.Repairs); err != nil {
			return nil, fmt.Errorf("register repair metrics: %w", err)
		}
	}
	return m, nil
}

// Options configure a Controller.
type Options struct {
	Policy Policy
	// Backend is the engine backend for the in-place repair (the agent's --backend).
	Backend backend.Kind
	Client  kubernetes.Interface
	Events  record.EventRecorder
	Pods    Pods
	// Netns finds pods' network namespaces (default: podnetns.Finder{} with the
	// default directories and /proc).
	Netns Netns
	// Apply writes rules (default engine.Apply).
	Apply ApplyFunc
	// Evictor evicts pods (ActionEvict; pkg/heal, shared with the audit).
	Evictor *heal.Evictor
	// Decisions, when set: a pod whose sandbox's ADD skipped it is never acted on
	// (its current annotations disagree with its ADD): reported once.
	Decisions Decisions
	// ReadyToDelete, when set, must return nil before a pod is deleted: the agent's
	// plugin installed, so the recreated pod gets its redirect at ADD.
	ReadyToDelete func() error
	Metrics       *Metrics
	Log           *slog.Logger
	// Workers process pods in parallel (default 4).
	Workers int
	// MaxAttempts bounds the attempts of one action (default 5); NewRateLimiter
	// spaces them.
	MaxAttempts int
}

// Controller repairs the node's broken pods.
type Controller struct {
	o     Options
	queue workqueue.TypedRateLimitingInterface[string]
	mu    sync.Mutex
	done  map[types.UID]*podState
}

// podState is what the controller did to one pod (by UID).
type podState struct {
	keys       map[string]bool // decision keys handled (acted on, given up or covered)
	repairs    int             // successful in-place repairs
	lastRepair time.Time
}

// New builds a controller and registers its handlers on the pod informer: call it
// before the informer runs.
func New(o Options) (*Controller, error) {
	if o.Client == nil || o.Pods == nil || o.Events == nil {
		return nil, errors.New("repair: a client, an Event recorder and the node's pods are needed")
	}
	if _, err := ParseAction(string(o.Policy.Action)); err != nil {
		return nil, fmt.Errorf("repair: %w", err)
	}
	if o.Policy.Action == ActionLabel {
		if _, err := ParseLabelKey(o.Policy.LabelKey); err != nil {
			return nil, fmt.Errorf("repair: %w", err)
		}
	}
	if o.Netns == nil {
		o.Netns = &podnetns.Locator{}
	}
	if o.Apply == nil {
		o.Apply = engine.Apply
	}
	if o.Log == nil {
		o.Log = slog.Default()
	}
	if o.Workers <= 0 {
		o.Workers = defaultWorkers
	}
	if o.MaxAttempts <= 0 {
		o.MaxAttempts = 5
	}
	if o.Metrics == nil {
		m, err := NewMetrics(nil)
		if err != nil {
			return nil, err
		}
		o.Metrics = m
	}
	for _, r := range []string{resultSuccess, resultError, resultRefused} {
		o.Metrics.Repairs.WithLabelValues(string(o.Policy.Action), r)
	}
	c := &Controller{
		o: o,
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(NewRateLimiter(),
			workqueue.TypedRateLimitingQueueConfig[string]{Name: "meshcni-repair"}),
		done: map[types.UID]*podState{},
	}
	_, err := o.Pods.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    c.observe,
		UpdateFunc: func(_, obj any) { c.observe(obj) },
		DeleteFunc: c.forget,
	})
	if err != nil {
		return nil, fmt.Errorf("repair: pod handler: %w", err)
	}
	return c, nil
}

// Name implements the agent's Runnable.
func (c *Controller) Name() string { return "repair" }

// observe queues a pod that looks broken (the cheap test; Decide runs again in the
// worker on the latest cached pod).
func (c *Controller) observe(obj any) {
	pod, ok := obj.(*corev1.Pod)
	if !ok {
		return
	}
	if f, why := c.o.Policy.Criteria.Broken(pod); f == nil {
		c.o.Log.Debug(LogNotBroken, "pod_namespace", pod.Namespace, "pod_name", pod.Name, "pod_uid", string(pod.UID), "reason", why)
		return
	}
	key, err := cache.MetaNamespaceKeyFunc(pod)
	if err != nil {
		return
	}
	c.queue.Add(key)
}

// forget drops what was done to a deleted pod.
func (c *Controller) forget(obj any) {
	if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = t.Obj
	}
	if pod, ok := obj.(*corev1.Pod); ok {
		c.mu.Lock()
		delete(c.done, pod.UID)
		c.mu.Unlock()
	}
}

// Run processes the queue once the pod cache has synced, until ctx ends.
func (c *Controller) Run(ctx context.Context) error {
	defer c.queue.ShutDown()
	p := c.o.Policy
	if !c.o.Pods.WaitForSync(ctx) {
		return nil // ctx ended
	}
	c.o.Log.Info(LogWatching, "action", p.Action, "init_container", p.Criteria.InitContainer,
		"exit_code", p.Criteria.ExitCode, "message", fmt.Sprint(p.Criteria.Message), "label_selector", fmt.Sprint(p.LabelSelector),
		"field_selector", fmt.Sprint(p.FieldSelector), "workers", c.o.Workers)
	var wg sync.WaitGroup
	for range c.o.Workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for c.next(ctx) {
			}
		}()
	}
	<-ctx.Done()
	c.queue.ShutDown()
	wg.Wait()
	return nil
}

func (c *Controller) next(ctx context.Context) bool {
	key, quit := c.queue.Get()
	if quit {
		return false
	}
	defer c.queue.Done(key)
	c.process(ctx, key)
	return true
}

// state returns what was done to pod, creating the record; nil when the cache no
// longer holds the pod (same UID): it was deleted meanwhile, and forget has run or
// will run, so a record made now would never be dropped. Call it with c.mu held. The
// informer updates its cache before it calls forget, and forget takes c.mu, so a pod
// found here is forgotten after this record is made, never before.
func (c *Controller) state(pod *corev1.Pod) *podState {
	st := c.done[pod.UID]
	if st != nil {
		return st
	}
	if cur, ok := c.o.Pods.Get(pod.Namespace, pod.Name); !ok || cur.UID != pod.UID {
		return nil
	}
	st = &podState{keys: map[string]bool{}}
	c.done[pod.UID] = st
	return st
}

// tracked is the number of pods with a record (tests: it must not outgrow the node's pods).
func (c *Controller) tracked() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.done)
}

// handled reports whether the decision needs no action: its key was handled, or (in
// place) the failed run started no later than the last repair of the pod, so it may
// have run before the rules were there (times have a resolution of one second).
// A pod repaired MaxRepairsPerPod times is not repaired again: it fails for another
// reason; that is reported once (giveUp). A pod deleted meanwhile needs nothing.
func (c *Controller) handled(pod *corev1.Pod, d Decision) (done, giveUp bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	st := c.state(pod)
	if st == nil || st.keys[d.Key] {
		return true, false
	}
	if d.Action == ActionRepair && st.repairs > 0 {
		if d.Failure.StartedAt.Unix() <= st.lastRepair.Unix() {
			st.keys[d.Key] = true
			return true, false
		}
		if st.repairs >= MaxRepairsPerPod {
			st.keys[d.Key] = true
			return true, true
		}
	}
	return false, false
}

func (c *Controller) markDone(pod *corev1.Pod, d Decision, repaired time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	st := c.state(pod)
	if st == nil { // deleted meanwhile (e.g. by the delete action): nothing to remember
		return
	}
	st.keys[d.Key] = true
	if !repaired.IsZero() {
		st.repairs++
		st.lastRepair = repaired
	}
}

// errRetry is a transient condition that is retried without counting as a failure
// (a stale cached pod, the plugin not installed yet).
type errRetry struct{ error }

// errRefused is a condition under which acting could hurt another pod (its
// namespace is not verified to be its sandbox's): reported once, not retried.
type errRefused struct{ error }

// refused wraps the netns errors that forbid acting.
func refused(err error) error {
	if errors.Is(err, podnetns.ErrGone) || errors.Is(err, podnetns.ErrMismatch) || errors.Is(err, podnetns.ErrAmbiguous) {
		return errRefused{err}
	}
	return err
}

func (c *Controller) process(ctx context.Context, key string) {
	ns, name, err := cache.SplitMetaNamespaceKey(key)
	if err != nil {
		c.queue.Forget(key)
		return
	}
	pod, ok := c.o.Pods.Get(ns, name)
	if !ok {
		c.queue.Forget(key)
		return
	}
	d := Decide(pod, c.o.Policy)
	log := c.o.Log.With("pod_namespace", ns, "pod_name", name, "pod_uid", string(pod.UID))
	if !d.Act {
		log.Debug(LogNothingToDo, "reason", d.Reason)
		c.queue.Forget(key)
		return
	}
	if done, giveUp := c.handled(pod, d); done {
		c.queue.Forget(key)
		if !giveUp {
			log.Debug(LogNothingToDo, "reason", "this failed run was handled", "container_id", d.Failure.ContainerID)
		}
		if giveUp {
			msg := fmt.Sprintf("meshcni repaired the pod's traffic redirect in place %d times and %s still fails (exit %d): the redirect may not be the cause; not repairing again",
				MaxRepairsPerPod, d.Failure.Container, d.Failure.ExitCode)
			c.o.Events.Event(pod, corev1.EventTypeWarning, ReasonGaveUp, msg)
			log.Error(LogGaveUp, "action", d.Action, "reason", d.Reason, "repairs", MaxRepairsPerPod)
		}
		return
	}
	start := time.Now()
	detail, err := c.actOnDecided(ctx, pod, d)
	var retry errRetry
	var refuse errRefused
	switch {
	case err == nil:
		c.queue.Forget(key)
		var repaired time.Time
		if d.Action == ActionRepair {
			repaired = time.Now()
		}
		c.markDone(pod, d, repaired)
		c.o.Metrics.Repairs.WithLabelValues(string(d.Action), resultSuccess).Inc()
		c.o.Events.Event(pod, corev1.EventTypeNormal, successReason(d.Action), detail)
		log.Info(LogSucceeded, "action", d.Action, "result", resultSuccess, "detail", detail, "reason", d.Reason,
			"container_id", d.Failure.ContainerID, "duration", time.Since(start))
	case errors.As(err, &retry):
		log.Debug(LogRetryLater, "action", d.Action, "reason", retry.Error())
		c.queue.AddAfter(key, retryAfter)
	case errors.As(err, &refuse):
		c.queue.Forget(key)
		c.markDone(pod, d, time.Time{})
		c.o.Metrics.Repairs.WithLabelValues(string(d.Action), resultRefused).Inc()
		c.o.Events.Event(pod, corev1.EventTypeWarning, ReasonRefused, "meshcni: "+refuse.Error()+"; nothing was changed or deleted")
		log.Warn(LogRefused, "action", d.Action, "result", resultRefused, "reason", d.Reason, "err", refuse.error)
	case ctx.Err() != nil:
	default:
		c.o.Metrics.Repairs.WithLabelValues(string(d.Action), resultError).Inc()
		attempts := c.queue.NumRequeues(key) + 1
		msg := fmt.Sprintf("meshcni could not %s the unredirected pod (attempt %d of %d): %v", verb(d.Action), attempts, c.o.MaxAttempts, err)
		if attempts >= c.o.MaxAttempts {
			c.queue.Forget(key)
			c.markDone(pod, d, time.Time{})
			c.o.Events.Event(pod, corev1.EventTypeWarning, ReasonGaveUp, msg+"; giving up on this pod")
			log.Error(LogGaveUp, "action", d.Action, "result", resultError, "reason", d.Reason, "err", err, "attempts", attempts)
			return
		}
		c.o.Events.Event(pod, corev1.EventTypeWarning, ReasonFailed, msg)
		log.Warn(LogFailed, "action", d.Action, "result", resultError, "reason", d.Reason, "err", err, "attempts", attempts)
		c.queue.AddRateLimited(key)
	}
}

func successReason(a Action) string {
	switch a {
	case ActionEvict:
		return ReasonDeleted
	case ActionLabel:
		return ReasonLabeled
	}
	return ReasonRepaired
}

func verb(a Action) string {
	switch a {
	case ActionEvict:
		return "evict"
	case ActionLabel:
		return "label"
	}
	return "repair in place"
}

// actOnDecided refuses a pod its sandbox's ADD skipped, else acts.
func (c *Controller) actOnDecided(ctx context.Context, pod *corev1.Pod, d Decision) (string, error) {
	if c.o.Decisions != nil {
		if rec, why := c.o.Decisions.Decided(pod); rec == sandboxstate.Skipped {
			return "", errRefused{fmt.Errorf("the pod's sandbox's ADD skipped it (%s); its annotations changed since: not acting on them", why)}
		}
	}
	return c.act(ctx, pod, d)
}

// act runs the decided action and returns the success message.
func (c *Controller) act(ctx context.Context, pod *corev1.Pod, d Decision) (string, error) {
	why := fmt.Sprintf("init container %s exited %d", d.Failure.Container, d.Failure.ExitCode)
	switch d.Action {
	case ActionRepair:
		netns, kind, err := c.repairInPlace(ctx, pod)
		if err != nil {
			return "", err
		}
		return fmt.Sprintf("meshcni applied the traffic redirect in place after %s (backend %s, netns %s); the next run of %s passes",
			why, kind, netns, d.Failure.Container), nil
	case ActionEvict:
		if c.o.ReadyToDelete != nil {
			if err := c.o.ReadyToDelete(); err != nil {
				return "", errRetry{fmt.Errorf("plugin not installed yet: %w", err)}
			}
		}
		if c.o.Evictor == nil {
			return "", errors.New("not evicting: no eviction path configured")
		}
		err := c.o.Evictor.Evict(ctx, pod)
		if r, ok := heal.IsRefused(err); ok {
			return "", errRefused{r}
		}
		switch {
		case apierrors.IsConflict(err):
			return "", errRetry{fmt.Errorf("stale pod (resourceVersion %s): %w", pod.ResourceVersion, err)}
		case err != nil:
			return "", err
		}
		return fmt.Sprintf("meshcni evicted the pod after %s (the traffic redirect was missing); its controller recreates it with the redirect", why), nil
	case ActionLabel:
		// The UID and the resourceVersion the decision was made from: the API server
		// refuses the patch (Conflict) when the pod is a namesake recreated meanwhile
		// or changed since (its validation may have passed), and the pod is judged
		// again from the cache, as for delete.
		patch, err := json.Marshal(map[string]any{"metadata": map[string]any{
			"labels":          map[string]string{c.o.Policy.LabelKey: LabelValue},
			"uid":             pod.UID,
			"resourceVersion": pod.ResourceVersion,
		}})
		if err != nil {
			return "", err
		}
		_, err = c.o.Client.CoreV1().Pods(pod.Namespace).Patch(ctx, pod.Name, types.MergePatchType, patch, metav1.PatchOptions{})
		switch {
		case apierrors.IsConflict(err):
			return "", errRetry{fmt.Errorf("stale pod (resourceVersion %s): %w", pod.ResourceVersion, err)}
		case apierrors.IsNotFound(err):
			return "pod already gone", nil
		case err != nil:
			return "", fmt.Errorf("label: %w", err)
		}
		return fmt.Sprintf("meshcni labelled the pod %s=%s after %s (the traffic redirect is missing)", c.o.Policy.LabelKey, LabelValue, why), nil
	}
	return "", fmt.Errorf("unknown action %q", d.Action)
}

// repairInPlace locates the pod's netns by its sandbox and applies its redirect
// there, through the namespace's open handle: the namespace found and verified is
// the one written, even if the path it was found through leads elsewhere meanwhile
// (a PID reused). A namespace not verified to be the pod's sandbox's (gone,
// another, several) is refused: nothing is written.
func (c *Controller) repairInPlace(ctx context.Context, pod *corev1.Pod) (string, backend.Kind, error) {
	ips, err := podnetns.PodIPs(pod)
	if err != nil {
		return "", "", err
	}
	if len(ips) == 0 {
		return "", "", errRetry{fmt.Errorf("%w", podnetns.ErrNoPodIP)}
	}
	res, err := c.o.Policy.Mesh.ForPod(k8spod.From(pod), ips)
	if err != nil {
		return "", "", fmt.Errorf("redirect spec: %w", err)
	}
	for _, w := range res.Warnings {
		c.o.Log.Warn(w, "pod_namespace", pod.Namespace, "pod_name", pod.Name)
	}
	h, err := c.o.Netns.Locate(ctx, pod)
	if err != nil {
		return "", "", refused(fmt.Errorf("locate the pod's network namespace: %w", err))
	}
	defer h.Close()
	kind, err := c.o.Apply(ctx, engine.Options{Backend: c.o.Backend, NetnsPath: h.NetnsPath(), Logger: c.o.Log}, res.Spec)
	if err != nil {
		return h.Path, kind, fmt.Errorf("apply the redirect in %s: %w", h.Path, err)
	}
	return h.Path, kind, nil
}
