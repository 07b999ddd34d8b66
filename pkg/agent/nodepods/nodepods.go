// Package nodepods is the agent's view of the pods of its own node: one client-go
// informer with a field selector on spec.nodeName, so the agent's memory grows with the
// node's pods, not the cluster's. The repair controller and the plugin's pod lookup
// share it.
package nodepods

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	listerscorev1 "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
)

// Cache holds the node's pods.
type Cache struct {
	// Log, when set, gets one line when the first list is in the cache.
	Log *slog.Logger

	node     string
	factory  informers.SharedInformerFactory
	informer cache.SharedIndexInformer
	lister   listerscorev1.PodLister
}

// New returns a cache of node's pods; nothing is watched until Run. resync 0 never
// re-delivers unchanged pods to handlers.
func New(cs kubernetes.Interface, node string, resync time.Duration) (*Cache, error) {
	if node == "" {
		return nil, fmt.Errorf("node pods: no node name (set --node-name from the downward API)")
	}
	f := informers.NewSharedInformerFactoryWithOptions(cs, resync,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", node).String()
		}),
		informers.WithTransform(Trim))
	pods := f.Core().V1().Pods()
	c := &Cache{node: node, factory: f, informer: pods.Informer(), lister: pods.Lister()}
	return c, nil
}

// Trim drops what no reader of the cache needs (managed fields), to keep the agent small.
func Trim(obj any) (any, error) {
	if p, ok := obj.(*corev1.Pod); ok {
		p.ManagedFields = nil
	}
	return obj, nil
}

// Name is the Runnable's name.
func (c *Cache) Name() string { return "node-pods" }

// Node is the node whose pods are cached.
func (c *Cache) Node() string { return c.node }

// Run watches until ctx ends. Handlers must be added before Run.
func (c *Cache) Run(ctx context.Context) error {
	began := time.Now()
	c.factory.Start(ctx.Done())
	if c.Log != nil && c.WaitForSync(ctx) {
		c.Log.Info("node pods cached", "node", c.node, "pods", len(c.List()), "took", time.Since(began).Round(time.Millisecond).String())
	}
	<-ctx.Done()
	c.factory.Shutdown()
	return nil
}

// WaitForSync blocks until the first list is in the cache or ctx ends (false).
func (c *Cache) WaitForSync(ctx context.Context) bool {
	return cache.WaitForCacheSync(ctx.Done(), c.informer.HasSynced)
}

// HasSynced reports whether the first list is in the cache.
func (c *Cache) HasSynced() bool { return c.informer.HasSynced() }

// Informer is the shared pod informer, for adding event handlers before Run.
func (c *Cache) Informer() cache.SharedIndexInformer { return c.informer }

// Get returns the cached pod, or false when it is not (yet) in the cache. The pod is
// shared: do not modify it.
func (c *Cache) Get(namespace, name string) (*corev1.Pod, bool) {
	p, err := c.lister.Pods(namespace).Get(name)
	if err != nil {
		return nil, false
	}
	return p, true
}

// List returns every cached pod (shared, read-only).
func (c *Cache) List() []*corev1.Pod {
	ps, _ := c.lister.List(labelsEverything)
	return ps
}

var labelsEverything = labels.Everything()
