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

	census  *census
	breaker *breaker
	addMu   sync.Mutex // one add at a time: the limit is checked and the taint written under it

	unboundMu sync.Mutex
	unbound   map[types.UID]bool // agent pods without spec.nodeName, logged once each

	now    func() time.Time
	synced atomic.Bool
}

// New builds a controller on cs; nothing runs until Run.
func New(cs kubernetes.Interface, cfg *Config, log *slog.Logger) (*Controller, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	c := &Controller{
		cfg:     cfg,
		cs:      cs,
		log:     log,
		state:   map[string]NodeState{},
		census:  newCensus(),
		breaker: newBreaker(),
		unbound: map[types.UID]bool{},
		now:     time.Now,
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
		AddFunc: func(obj any) { c.seeNode(obj); c.enqueueNode(obj) },
		UpdateFunc: func(old, cur any) {
			c.seeNode(cur)
			o, ok1 := old.(*corev1.Node)
			n, ok2 := cur.(*corev1.Node)
			// A periodic resync (same version), or a change of what the decision reads.
			if !ok1 || !ok2 || o.ResourceVersion == n.ResourceVersion ||
				!equality.Semantic.DeepEqual(o.Spec.Taints, n.Spec.Taints) || !equality.Semantic.DeepEqual(o.Labels, n.Labels) ||
				HasMark(o) != HasMark(n) || (o.DeletionTimestamp == nil) != (n.DeletionTimestamp == nil) {
				c.enqueueNode(cur)
			}
		},
		DeleteFunc: func(obj any) {
			if n, ok := objectOf(obj).(*corev1.Node); ok {
				c.census.forget(n.Name)
			}
			c.enqueueNode(obj)
		},
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
		DeleteFunc: func(obj any) {
			if p, ok := objectOf(obj).(*corev1.Pod); ok {
				c.unboundMu.Lock()
				delete(c.unbound, p.UID)
				c.unboundMu.Unlock()
			}
			c.enqueuePodNode(obj)
		},
	}); err != nil {
		return nil, fmt.Errorf("pod handler: %w", err)
	}
	c.Metrics = NewMetrics(c.countTainted, c.breakerGauges)

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

// LogAgentUnbound is logged once per agent pod that has no spec.nodeName: it counts
// for no node until it is bound to one.
const LogAgentUnbound = "agent pod without spec.nodeName: it counts for no node"

func (c *Controller) enqueuePodNode(obj any) {
	p, ok := objectOf(obj).(*corev1.Pod)
	if !ok {
		return
	}
	if p.Spec.NodeName != "" {
		c.queue.Add(p.Spec.NodeName)
		return
	}
	c.unboundMu.Lock()
	first := !c.unbound[p.UID]
	c.unbound[p.UID] = true
	c.unboundMu.Unlock()
	if first {
		c.log.Info(LogAgentUnbound, "pod", p.Namespace+"/"+p.Name, "uid", string(p.UID))
	}
}

func (c *Controller) seeNode(obj any) {
	if n, ok := objectOf(obj).(*corev1.Node); ok {
		c.census.see(n)
	}
}

// breakerGauges is what the metrics read of the breaker: open (1 or 0) and the nodes
// whose taint it withholds. A replica that does not lead reports 0.
func (c *Controller) breakerGauges() (open, withheld float64) {
	s := c.breaker.state()
	if s.Open {
		open = 1
	}
	return open, float64(s.Withheld)
}

// Breaker returns the breaker's state (closed when this replica does not lead).
func (c *Controller) Breaker() BreakerState { return c.breaker.state() }

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
	c.breaker.reset()
	c.Metrics.Leader.Set(1)
	defer c.Metrics.Leader.Set(0)
	defer c.breaker.reset()
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
		c.settle(name)
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("node %s from cache: %w", name, err)
	}
	if node.DeletionTimestamp != nil {
		c.settle(name)
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
			"action", d.Action.String(), "reason", d.Reason, "grace_left", d.RequeueAfter.String(), "mark", d.Mark)
	}
	if d.Spared {
		c.log.Warn(LogSpared, "node", name, "reason", d.Reason)
	}
	if d.Action == Add {
		return 0, c.add(ctx, node, d)
	}
	c.settle(name)
	if d.Action == None && !d.Mark {
		return d.RequeueAfter, nil
	}
	return d.RequeueAfter, c.write(ctx, node, d)
}

// LogSpared is logged once per loss of a node's agent when the node is left untainted
// past its grace period because its agent was Ready there before (--taint-mode=joining).
const LogSpared = "agent not Ready past the grace period; node not tainted"

// LogMarked is logged when the controller records on a node that its agent was Ready.
const LogMarked = "recorded on the node that its agent was Ready (" + MarkAnnotation + ")"

// add puts the taint on node unless that would pass the limit (the breaker).
func (c *Controller) add(ctx context.Context, node *corev1.Node, d Decision) error {
	c.addMu.Lock()
	defer c.addMu.Unlock()
	now := c.now()
	managed, tainted := c.census.count(now)
	limit := Limit(managed, c.cfg.MaxTaintedFraction, c.cfg.MaxTaintedFloor)
	admit, opened, closed := c.breaker.ask(node.Name, managed, tainted, limit, now)
	if opened {
		c.reportOpen(node, d)
	}
	if closed {
		c.reportClosed(node)
	}
	if !admit {
		c.log.Debug("taint withheld by the breaker", "node", node.Name, "reason", d.Reason, "tainted", tainted, "limit", limit)
		return nil
	}
	if err := c.write(ctx, node, d); err != nil {
		return err
	}
	c.census.added(node.Name, now)
	return nil
}

// settle tells the breaker that node is not due the taint; the withheld nodes that
// fit within the limit again are decided again.
func (c *Controller) settle(name string) {
	if !c.breaker.isOpen() {
		return
	}
	managed, tainted := c.census.count(c.now())
	limit := Limit(managed, c.cfg.MaxTaintedFraction, c.cfg.MaxTaintedFloor)
	closed, retry := c.breaker.settle(name, managed, tainted, limit)
	if closed {
		if n, err := c.nodes.Get(name); err == nil {
			c.reportClosed(n)
		} else {
			c.reportClosed(nil)
		}
	}
	for _, n := range retry {
		c.queue.Add(n)
	}
}

func (c *Controller) reportOpen(node *corev1.Node, d Decision) {
	s := c.breaker.state()
	c.Metrics.BreakerTrips.Inc()
	c.log.Warn(LogBreakerOpen, "node", node.Name, "reason", d.Reason, "tainted", s.Tainted, "due", s.Withheld,
		"limit", s.Limit, "managed", s.Managed, "max_tainted_fraction", c.cfg.MaxTaintedFraction, "max_tainted_floor", c.cfg.MaxTaintedFloor)
	c.events.Eventf(node, corev1.EventTypeWarning, ReasonBreakerOpen,
		"not adding taint %s:%s (%s): %d of %d managed nodes carry it and %d more are due it, past the limit %d (--max-tainted-fraction %v, --max-tainted-floor %d); adding no taint until they fit, still removing taints as agents turn Ready",
		TaintKey, TaintEffect, d.Reason, s.Tainted, s.Managed, s.Withheld, s.Limit, c.cfg.MaxTaintedFraction, c.cfg.MaxTaintedFloor)
}

func (c *Controller) reportClosed(node *corev1.Node) {
	s := c.breaker.state()
	name := ""
	if node != nil {
		name = node.Name
	}
	c.log.Info(LogBreakerClosed, "node", name, "tainted", s.Tainted, "limit", s.Limit, "managed", s.Managed)
	if node != nil {
		c.events.Eventf(node, corev1.EventTypeNormal, ReasonBreakerClosed,
			"taint %s:%s breaker closed: every node due the taint fits within the limit %d of %d managed nodes", TaintKey, TaintEffect, s.Limit, s.Managed)
	}
}

// write sends the decision's change of node (taint, mark) through the fence and
// records it.
func (c *Controller) write(ctx context.Context, node *corev1.Node, d Decision) error {
	name := node.Name
	mark := ""
	if d.Mark {
		mark = MarkValue(c.now())
	}
	wctx, release, err := c.writeContext(ctx, name)
	if err != nil {
		return err
	}
	res, err := writeNode(wctx, c.cs, node, d.Action, mark)
	release()
	if err != nil {
		return fmt.Errorf("%s taint on node %s: %w", d.Action, name, err)
	}
	if res.marked {
		c.Metrics.Marks.Inc()
		c.log.Info(LogMarked, "node", name, "value", mark)
	}
	if !res.changed {
		return nil
	}
	if d.Action == Remove {
		c.census.removed(name)
	}
	c.Metrics.Changes.WithLabelValues(d.Action.String()).Inc()
	reason, verb := ReasonTaintAdded, "added"
	if d.Action == Remove {
		reason, verb = ReasonTaintRemoved, "removed"
	}
	msg := fmt.Sprintf("%s taint %s:%s: %s", verb, TaintKey, TaintEffect, d.Reason)
	c.events.Event(node, corev1.EventTypeNormal, reason, msg)
	c.log.Info(msg, "node", name, "action", d.Action.String())
	return nil
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

// nodePatch is a JSON merge patch of a node's taints and of MarkAnnotation, with the
// resourceVersion it was computed from: the API server refuses it with a Conflict if
// the node changed since.
type nodePatch struct {
	Metadata struct {
		ResourceVersion string            `json:"resourceVersion"`
		Annotations     map[string]string `json:"annotations,omitempty"`
	} `json:"metadata"`
	Spec *nodePatchSpec `json:"spec,omitempty"`
}

type nodePatchSpec struct {
	Taints []corev1.Taint `json:"taints"`
}

// NodePatch is the controller's patch of base: the taint added (Add) or removed
// (Remove) with every other taint kept in order, and MarkAnnotation set to mark when
// mark is not empty and the node lacks it. changed is false when the node is already as
// wanted (no patch to send).
func NodePatch(base *corev1.Node, taint Action, mark string) (body []byte, changed bool, err error) {
	var p nodePatch
	p.Metadata.ResourceVersion = base.ResourceVersion
	if taint != None {
		taints, diff := WithTaint(base.Spec.Taints, taint == Add)
		if diff {
			p.Spec = &nodePatchSpec{}
			if len(taints) > 0 {
				p.Spec.Taints = taints
			}
		}
	}
	if mark != "" && !HasMark(base) {
		p.Metadata.Annotations = map[string]string{MarkAnnotation: mark}
	}
	if p.Spec == nil && p.Metadata.Annotations == nil {
		return nil, false, nil
	}
	body, err = json.Marshal(p)
	if err != nil {
		return nil, false, fmt.Errorf("node patch: %w", err)
	}
	return body, true, nil
}

// writeResult says what a node write changed.
type writeResult struct {
	changed bool // the taint
	marked  bool // MarkAnnotation written
}

// writeNode puts the taint on the node (Add) or takes it off (Remove), keeping every
// other taint, and writes MarkAnnotation when mark is set and the node lacks it. It
// starts from base (the cache) and, on a conflict, re-reads the node and tries again.
func writeNode(ctx context.Context, cs kubernetes.Interface, base *corev1.Node, taint Action, mark string) (res writeResult, err error) {
	name := base.Name
	err = retry.RetryOnConflict(retry.DefaultBackoff, func() error {
		res = writeResult{}
		if base == nil {
			n, err := cs.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return err
			}
			base = n
		}
		body, diff, err := NodePatch(base, taint, mark)
		if err != nil || !diff {
			return err
		}
		tainted, marked := HasTaint(base), HasMark(base)
		base = nil // a retry re-reads the node
		n, err := cs.CoreV1().Nodes().Patch(ctx, name, types.MergePatchType, body, metav1.PatchOptions{FieldManager: Component})
		if err != nil {
			return err
		}
		res = writeResult{changed: HasTaint(n) != tainted, marked: HasMark(n) && !marked}
		return nil
	})
	if apierrors.IsNotFound(err) {
		return writeResult{}, nil // the node is gone: nothing to taint
	}
	return res, err
}

// setTaint puts the taint on the node (want) or takes it off, keeping every other taint
// (writeNode without a mark). changed is false when the node was already as wanted.
func setTaint(ctx context.Context, cs kubernetes.Interface, base *corev1.Node, want bool) (changed bool, err error) {
	a := Remove
	if want {
		a = Add
	}
	res, err := writeNode(ctx, cs, base, a, "")
	return res.changed, err
}
