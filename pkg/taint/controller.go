package taint

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	listerscorev1 "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/retry"
	"k8s.io/client-go/util/workqueue"
)

// Component is the controller's name in Events, its API client's user agent and its
// field manager.
const Component = "meshcni-taint-controller"

// Event reasons on the Node.
const (
	ReasonTaintAdded   = "TaintAdded"
	ReasonTaintRemoved = "TaintRemoved"
)

const nodeNameIndex = "spec.nodeName"

// LogDecided is the debug record of every decision about a node: the node's
// resourceVersion, the agent pods seen on it ("namespace/name ready=true|false"), the
// action and its reason.
const LogDecided = "node decided"

// Controller keeps the taint in step with the agent pods. Its caches (nodes, agent
// pods) run in every replica; only the leader reconciles and writes.
type Controller struct {
	cfg     *Config
	cs      kubernetes.Interface
	log     *slog.Logger
	Metrics *Metrics

	events     record.EventRecorder
	stopEvents func()
	nodeF      informers.SharedInformerFactory
	podF       informers.SharedInformerFactory
	nodeInf    cache.SharedIndexInformer
	podInf     cache.SharedIndexInformer
	nodes      listerscorev1.NodeLister
	queue      workqueue.TypedRateLimitingInterface[string]
	watchdog   *leaderelection.HealthzAdaptor
	fence      *fence // nil without leader election

	mu    sync.Mutex
	state map[string]NodeState

	now    func() time.Time
	synced atomic.Bool
}

// New builds a controller on cs; nothing runs until Run.
func New(cs kubernetes.Interface, cfg *Config, log *slog.Logger) (*Controller, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	c := &Controller{
		cfg:   cfg,
		cs:    cs,
		log:   log,
		state: map[string]NodeState{},
		now:   time.Now,
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(workqueue.DefaultTypedControllerRateLimiter[string](),
			workqueue.TypedRateLimitingQueueConfig[string]{Name: "meshcni-taint-nodes"}),
		// Unhealthy when leading and the Lease was not renewed for a renew deadline past
		// its duration: the process is stuck.
		watchdog: leaderelection.NewLeaderHealthzAdaptor(cfg.RenewDeadline),
	}
	if cfg.LeaderElect {
		c.fence = newFence(cfg.Identity, cfg.RenewDeadline)
	}
	nodeSel := cfg.NodeSelector.String()
	c.nodeF = informers.NewSharedInformerFactoryWithOptions(cs, cfg.Resync,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = nodeSel }),
		informers.WithTransform(trim))
	agentSel := cfg.AgentSelector.String()
	c.podF = informers.NewSharedInformerFactoryWithOptions(cs, 0,
		informers.WithNamespace(cfg.AgentNamespace),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = agentSel }),
		informers.WithTransform(trim))
	ni := c.nodeF.Core().V1().Nodes()
	c.nodeInf, c.nodes = ni.Informer(), ni.Lister()
	c.podInf = c.podF.Core().V1().Pods().Informer()
	if err := c.podInf.AddIndexers(cache.Indexers{nodeNameIndex: func(obj any) ([]string, error) {
		if p, ok := obj.(*corev1.Pod); ok && p.Spec.NodeName != "" {
			return []string{p.Spec.NodeName}, nil
		}
		return nil, nil
	}}); err != nil {
		return nil, fmt.Errorf("pod index: %w", err)
	}
	if _, err := c.nodeInf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) { c.enqueueNode(obj) },
		UpdateFunc: func(old, cur any) {
			o, ok1 := old.(*corev1.Node)
			n, ok2 := cur.(*corev1.Node)
			// A periodic resync (same version), or a change of what the decision reads.
			if !ok1 || !ok2 || o.ResourceVersion == n.ResourceVersion ||
				!equality.Semantic.DeepEqual(o.Spec.Taints, n.Spec.Taints) || !equality.Semantic.DeepEqual(o.Labels, n.Labels) ||
				(o.DeletionTimestamp == nil) != (n.DeletionTimestamp == nil) {
				c.enqueueNode(cur)
			}
		},
		DeleteFunc: func(obj any) { c.enqueueNode(obj) },
	}); err != nil {
		return nil, fmt.Errorf("node handler: %w", err)
	}
	if _, err := c.podInf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) { c.enqueuePodNode(obj) },
		UpdateFunc: func(old, cur any) {
			o, ok1 := old.(*corev1.Pod)
			p, ok2 := cur.(*corev1.Pod)
			if !ok1 || !ok2 || o.Spec.NodeName != p.Spec.NodeName || AgentPodReady(o) != AgentPodReady(p) ||
				(o.DeletionTimestamp == nil) != (p.DeletionTimestamp == nil) {
				c.enqueuePodNode(old)
				c.enqueuePodNode(cur)
			}
		},
		DeleteFunc: func(obj any) { c.enqueuePodNode(obj) },
	}); err != nil {
		return nil, fmt.Errorf("pod handler: %w", err)
	}
	c.Metrics = NewMetrics(c.countTainted)

	b := record.NewBroadcaster()
	b.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: cs.CoreV1().Events("")})
	c.events = b.NewRecorder(scheme.Scheme, corev1.EventSource{Component: Component})
	c.stopEvents = b.Shutdown
	return c, nil
}

// trim drops what the controller never reads, to keep its caches small.
func trim(obj any) (any, error) {
	switch o := obj.(type) {
	case *corev1.Node:
		o.ManagedFields = nil
		o.Status.Images = nil
	case *corev1.Pod:
		o.ManagedFields = nil
	}
	return obj, nil
}

func objectOf(obj any) any {
	if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		return t.Obj
	}
	return obj
}

func (c *Controller) enqueueNode(obj any) {
	if n, ok := objectOf(obj).(*corev1.Node); ok {
		c.queue.Add(n.Name)
	}
}

func (c *Controller) enqueuePodNode(obj any) {
	if p, ok := objectOf(obj).(*corev1.Pod); ok && p.Spec.NodeName != "" {
		c.queue.Add(p.Spec.NodeName)
	}
}

func (c *Controller) countTainted() float64 {
	if !c.synced.Load() {
		return 0
	}
	ns, err := c.nodes.List(labels.Everything())
	if err != nil {
		return 0
	}
	n := 0
	for _, node := range ns {
		if HasTaint(node) {
			n++
		}
	}
	return float64(n)
}

// Ready reports whether the caches hold the first full list of nodes and agent pods.
func (c *Controller) Ready() error {
	if !c.synced.Load() {
		return fmt.Errorf("caches not synced")
	}
	return nil
}

// Healthy reports an error when this replica leads but failed to renew its Lease for
// longer than its duration plus the renew deadline (a stuck process).
func (c *Controller) Healthy() error { return c.watchdog.Check(nil) }

// Run fills the caches, then acts on nodes while this replica leads (always with
// --leader-elect=false), until ctx ends (nil) or the leadership is lost (an error: exit
// and let the Deployment restart the pod, so that it starts afresh as a candidate).
func (c *Controller) Run(ctx context.Context) error {
	defer c.stopEvents()
	defer c.queue.ShutDown()
	defer c.podF.Shutdown()
	defer c.nodeF.Shutdown()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // runs first: the factories' Shutdown waits for their informers to stop
	c.nodeF.Start(ctx.Done())
	c.podF.Start(ctx.Done())
	began := time.Now()
	if !cache.WaitForCacheSync(ctx.Done(), c.nodeInf.HasSynced, c.podInf.HasSynced) {
		return fmt.Errorf("caches of nodes and agent pods not synced: %w", context.Cause(ctx))
	}
	c.synced.Store(true)
	c.log.Info("caches synced", "took", time.Since(began).Round(time.Millisecond).String(),
		"nodes", len(c.nodeInf.GetStore().ListKeys()), "agentPods", len(c.podInf.GetStore().ListKeys()))
	if !c.cfg.LeaderElect {
		c.lead(ctx)
		return nil
	}
	return c.runElected(ctx)
}

// lead reconciles every node, then every change, until ctx ends.
func (c *Controller) lead(ctx context.Context) {
	c.Metrics.Leader.Set(1)
	defer c.Metrics.Leader.Set(0)
	c.log.Info("leading: reconciling nodes", "identity", c.cfg.Identity)
	for _, k := range c.nodeInf.GetStore().ListKeys() {
		c.queue.Add(k)
	}
	var wg sync.WaitGroup
	for range c.cfg.Workers {
		wg.Go(func() {
			for c.processNext(ctx) {
			}
		})
	}
	<-ctx.Done()
	c.queue.ShutDown() // wakes the workers waiting for a node
	wg.Wait()
	c.log.Info("stopped leading", "identity", c.cfg.Identity)
}

func (c *Controller) processNext(ctx context.Context) bool {
	name, shutdown := c.queue.Get()
	if shutdown {
		return false
	}
	defer c.queue.Done(name)
	if ctx.Err() != nil { // no longer leading: write nothing more
		return false
	}
	after, err := c.reconcile(ctx, name)
	if err != nil {
		if ctx.Err() != nil {
			return false
		}
		c.Metrics.Errors.Inc()
		c.log.Warn("reconcile failed; retrying", "node", name, "err", err.Error(), "retries", c.queue.NumRequeues(name))
		c.queue.AddRateLimited(name)
		return true
	}
	c.queue.Forget(name)
	if after > 0 {
		c.queue.AddAfter(name, after)
	}
	return true
}

// reconcile decides about one node and writes the change, if any. It returns when to
// look again (a grace period is running).
func (c *Controller) reconcile(ctx context.Context, name string) (time.Duration, error) {
	node, err := c.nodes.Get(name)
	if apierrors.IsNotFound(err) || (err == nil && !c.cfg.NodeSelector.Matches(labels.Set(node.Labels))) {
		c.mu.Lock()
		delete(c.state, name)
		c.mu.Unlock()
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("node %s from cache: %w", name, err)
	}
	if node.DeletionTimestamp != nil {
		return 0, nil
	}
	objs, err := c.podInf.GetIndexer().ByIndex(nodeNameIndex, name)
	if err != nil {
		return 0, fmt.Errorf("agent pods of node %s: %w", name, err)
	}
	pods := make([]*corev1.Pod, 0, len(objs))
	for _, o := range objs {
		if p, ok := o.(*corev1.Pod); ok {
			pods = append(pods, p)
		}
	}
	c.mu.Lock()
	st := c.state[name]
	c.mu.Unlock()
	d, st := Decide(node, pods, st, c.now(), c.cfg.Policy())
	c.mu.Lock()
	c.state[name] = st
	c.mu.Unlock()
	if c.log.Enabled(ctx, slog.LevelDebug) {
		c.log.Debug(LogDecided, "node", name, "resource_version", node.ResourceVersion, "agent_pods", agentPods(pods),
			"action", d.Action.String(), "reason", d.Reason, "grace_left", d.RequeueAfter.String())
	}
	if d.Action == None {
		return d.RequeueAfter, nil
	}
	wctx, release, err := c.writeContext(ctx, name)
	if err != nil {
		return 0, err
	}
	changed, err := setTaint(wctx, c.cs, node, d.Action == Add)
	release()
	if err != nil {
		return 0, fmt.Errorf("%s taint on node %s: %w", d.Action, name, err)
	}
	if !changed {
		return 0, nil
	}
	c.Metrics.Changes.WithLabelValues(d.Action.String()).Inc()
	reason, verb := ReasonTaintAdded, "added"
	if d.Action == Remove {
		reason, verb = ReasonTaintRemoved, "removed"
	}
	msg := fmt.Sprintf("%s taint %s:%s: %s", verb, TaintKey, TaintEffect, d.Reason)
	c.events.Event(node, corev1.EventTypeNormal, reason, msg)
	c.log.Info(msg, "node", name, "action", d.Action.String())
	return 0, nil
}

// LogWriteHeld is logged when a node write waits because the Lease was not renewed
// within --renew-deadline (the fence lapsed): the write is sent only after a renewal,
// and never if leadership ends first.
const LogWriteHeld = "node write held: the Lease was not renewed within the renew deadline"

// writeContext waits until this replica may write (its Lease fence holds) and returns
// the context of one write, which ends when the fence lapses; an error once ctx ended
// (no longer leading) first.
func (c *Controller) writeContext(ctx context.Context, node string) (context.Context, context.CancelFunc, error) {
	if c.fence == nil {
		return ctx, func() {}, nil
	}
	if lapsed, since := c.fence.lapsed(); lapsed {
		c.log.Info(LogWriteHeld, "node", node, "lapsed_since", since.Format(time.RFC3339Nano))
	}
	wctx, cancel, err := c.fence.hold(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("node %s: not written, no longer leading: %w", node, err)
	}
	return wctx, cancel, nil
}

// agentPods names the agent pods and whether each counts as Ready, for the logs.
func agentPods(pods []*corev1.Pod) string {
	var b strings.Builder
	for i, p := range pods {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%s/%s ready=%t", p.Namespace, p.Name, AgentPodReady(p))
	}
	return b.String()
}

// taintPatch is a JSON merge patch of a node's taints, with the resourceVersion it was
// computed from: the API server refuses it with a Conflict if the node changed since.
type taintPatch struct {
	Metadata struct {
		ResourceVersion string `json:"resourceVersion"`
	} `json:"metadata"`
	Spec struct {
		Taints []corev1.Taint `json:"taints"`
	} `json:"spec"`
}

// setTaint puts the taint on the node (want) or takes it off, keeping every other taint.
// It starts from base (the cache) and, on a conflict, re-reads the node and tries again.
// changed is false when the node was already as wanted.
func setTaint(ctx context.Context, cs kubernetes.Interface, base *corev1.Node, want bool) (changed bool, err error) {
	name := base.Name
	err = retry.RetryOnConflict(retry.DefaultBackoff, func() error {
		changed = false
		if base == nil {
			n, err := cs.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return err
			}
			base = n
		}
		taints, diff := WithTaint(base.Spec.Taints, want)
		if !diff {
			return nil
		}
		var p taintPatch
		p.Metadata.ResourceVersion = base.ResourceVersion
		if len(taints) > 0 {
			p.Spec.Taints = taints
		}
		body, err := json.Marshal(p)
		if err != nil {
			return fmt.Errorf("taint patch: %w", err)
		}
		base = nil // a retry re-reads the node
		if _, err := cs.CoreV1().Nodes().Patch(ctx, name, types.MergePatchType, body, metav1.PatchOptions{FieldManager: Component}); err != nil {
			return err
		}
		changed = true
		return nil
	})
	if apierrors.IsNotFound(err) {
		return false, nil // the node is gone: nothing to taint
	}
	return changed, err
}
