package multinode

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	watchtools "k8s.io/client-go/tools/watch"
)

// NodeState is one version of a Node as a watch saw it.
type NodeState struct {
	// At is when the watch received it.
	At              time.Time
	ResourceVersion string
	// Deleted: the Node object was deleted (the other fields are its last version).
	Deleted       bool
	Ready         bool
	Unschedulable bool
	Taints        []corev1.Taint
}

func nodeState(n *corev1.Node, deleted bool) NodeState {
	s := NodeState{At: time.Now(), ResourceVersion: n.ResourceVersion, Deleted: deleted,
		Unschedulable: n.Spec.Unschedulable, Taints: slices.Clone(n.Spec.Taints)}
	for _, c := range n.Status.Conditions {
		if c.Type == corev1.NodeReady {
			s.Ready = c.Status == corev1.ConditionTrue
		}
	}
	return s
}

// Tainted reports a NoSchedule taint with key.
func (s NodeState) Tainted(key string) bool {
	return slices.ContainsFunc(s.Taints, func(t corev1.Taint) bool {
		return t.Key == key && t.Effect == corev1.TaintEffectNoSchedule
	})
}

// Free reports a node a pod without tolerations can be scheduled onto: it exists,
// is Ready and schedulable, and has no NoSchedule or NoExecute taint.
func (s NodeState) Free() bool {
	if s.Deleted || !s.Ready || s.Unschedulable {
		return false
	}
	return !slices.ContainsFunc(s.Taints, func(t corev1.Taint) bool {
		return t.Effect == corev1.TaintEffectNoSchedule || t.Effect == corev1.TaintEffectNoExecute
	})
}

func (s NodeState) String() string {
	var ts []string
	for _, t := range s.Taints {
		ts = append(ts, t.Key+":"+string(t.Effect))
	}
	return fmt.Sprintf("rv %s ready=%v unschedulable=%v deleted=%v taints=%v", s.ResourceVersion, s.Ready, s.Unschedulable, s.Deleted, ts)
}

// NodeWatch records every version of every Node from WatchNodes on (a list, then
// a watch that resumes from the last version it saw).
type NodeWatch struct {
	mu     sync.Mutex
	states map[string][]NodeState
	cancel context.CancelFunc
	done   chan struct{}
}

// WatchNodes starts recording the nodes' versions. on, when not nil, is called
// with each version in the watch's goroutine as it arrives (a check made there
// sees the world at that moment); the version is recorded before the call.
func WatchNodes(ctx context.Context, cs kubernetes.Interface, on func(name string, s NodeState)) (*NodeWatch, error) {
	list, err := cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("list nodes: %w", err)
	}
	ctx, cancel := context.WithCancel(ctx)
	w := &NodeWatch{states: map[string][]NodeState{}, cancel: cancel, done: make(chan struct{})}
	for i := range list.Items {
		w.add(&list.Items[i], false, on)
	}
	lw := &cache.ListWatch{WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
		return cs.CoreV1().Nodes().Watch(ctx, o)
	}}
	rw, err := watchtools.NewRetryWatcherWithContext(ctx, list.ResourceVersion, lw)
	if err != nil {
		cancel()
		return nil, fmt.Errorf("watch nodes: %w", err)
	}
	go func() {
		defer close(w.done)
		defer rw.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case ev, ok := <-rw.ResultChan():
				if !ok {
					return
				}
				if n, isNode := ev.Object.(*corev1.Node); isNode {
					w.add(n, ev.Type == watch.Deleted, on)
				}
			}
		}
	}()
	return w, nil
}

func (w *NodeWatch) add(n *corev1.Node, deleted bool, on func(string, NodeState)) {
	s := nodeState(n, deleted)
	w.mu.Lock()
	w.states[n.Name] = append(w.states[n.Name], s)
	w.mu.Unlock()
	if on != nil {
		on(n.Name, s)
	}
}

// States are the versions of node seen so far, in order.
func (w *NodeWatch) States(node string) []NodeState {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Clone(w.states[node])
}

// Stop ends the watch and waits for its goroutine.
func (w *NodeWatch) Stop() {
	w.cancel()
	<-w.done
}
