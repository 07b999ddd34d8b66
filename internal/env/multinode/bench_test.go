package multinode_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/meshcni/meshcni/internal/env/demo"
	"github.com/meshcni/meshcni/internal/env/multinode"
	"github.com/meshcni/meshcni/internal/env/testbed"
)

// joinWatch tells, per node name, when the Node object was first seen (its
// registration) and when the node was first free to take pods: for a meshed node
// only once meshcni's taint had come and gone.
type joinWatch struct {
	mu         sync.Mutex
	tainted    map[string]bool
	registered map[string]time.Time
	free       map[string]chan [2]time.Time // registered, free
}

func (jw *joinWatch) expect(name string) chan [2]time.Time {
	jw.mu.Lock()
	defer jw.mu.Unlock()
	ch := make(chan [2]time.Time, 1)
	jw.free[name] = ch
	return ch
}

func (jw *joinWatch) observe(name string, s multinode.NodeState, meshed bool) {
	jw.mu.Lock()
	defer jw.mu.Unlock()
	ch, ok := jw.free[name]
	if !ok {
		return
	}
	if _, ok := jw.registered[name]; !ok {
		jw.registered[name] = s.At
	}
	if s.Tainted(demo.NotReadyTaint) {
		jw.tainted[name] = true
	}
	if s.Free() && (!meshed || jw.tainted[name]) {
		ch <- [2]time.Time{jw.registered[name], s.At}
		delete(jw.free, name)
	}
}

// BenchmarkNodeJoin measures the time from a node's registration (its Node object
// first seen by a watch) to the node Ready and free to take pods, on the package's
// meshed cluster: with
// meshcni (the taint controller taints it; free once the agent there is Ready and
// the taint is gone) and without (a node labelled multinode.UnmeshedLabel at
// registration: no agent, no taint; free once the kubelet reports Ready and the
// node lifecycle controller lifts node.kubernetes.io/not-ready), one of each per
// iteration, in alternating order. Every node is removed before the next join.
// Reported: meshed-ms, unmeshed-ms (medians), meshed/unmeshed (their ratio) and
// added-ms (their difference: what meshcni adds to a join); add-meshed-ms and
// add-unmeshed-ms are the same from testbed.AddNode called (the test bed's own
// work first: certificates, namespaces, containerd, image imports).
func BenchmarkNodeJoin(b *testing.B) {
	c := cluster(b)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	jw := &joinWatch{tainted: map[string]bool{}, registered: map[string]time.Time{}, free: map[string]chan [2]time.Time{}}
	meshedName := map[string]bool{}
	var mu sync.Mutex
	w, err := multinode.WatchNodes(ctx, c.TB.Client, func(name string, s multinode.NodeState) {
		mu.Lock()
		meshed := meshedName[name]
		mu.Unlock()
		jw.observe(name, s, meshed)
	})
	if err != nil {
		b.Fatal(err)
	}
	defer w.Stop()
	var with, without, addWith, addWithout []time.Duration
	i := 0
	for b.Loop() {
		order := []bool{true, false}
		if i%2 == 1 {
			order = []bool{false, true}
		}
		for _, meshed := range order {
			i++
			name := fmt.Sprintf("mn-bench-%d", i)
			mu.Lock()
			meshedName[name] = meshed
			mu.Unlock()
			reg, add, err := timeJoin(ctx, c, jw, name, meshed)
			if err != nil {
				b.Fatal(err)
			}
			if meshed {
				with, addWith = append(with, reg), append(addWith, add)
			} else {
				without, addWithout = append(without, reg), append(addWithout, add)
			}
		}
	}
	m, u := median(with), median(without)
	b.ReportMetric(ms(m), "meshed-ms")
	b.ReportMetric(ms(u), "unmeshed-ms")
	b.ReportMetric(float64(m)/float64(u), "meshed/unmeshed")
	b.ReportMetric(ms(m-u), "added-ms")
	b.ReportMetric(ms(median(addWith)), "add-meshed-ms")
	b.ReportMetric(ms(median(addWithout)), "add-unmeshed-ms")
	b.Logf("registration to free: with meshcni %v, without %v", with, without)
	b.Logf("AddNode called to free: with meshcni %v, without %v", addWith, addWithout)
}

// timeJoin adds a node, waits until the watch sees it free and removes it. It
// returns the time from the Node's registration and from AddNode called.
func timeJoin(ctx context.Context, c *multinode.Cluster, jw *joinWatch, name string, meshed bool) (fromReg, fromAdd time.Duration, err error) {
	free := jw.expect(name)
	var o testbed.NodeOptions
	if !meshed {
		o.Labels = map[string]string{multinode.UnmeshedLabel: "true"}
	}
	began := time.Now()
	n, err := c.TB.AddNodeWith(ctx, name, o)
	if err != nil {
		return 0, 0, err
	}
	defer func() { _ = n.Remove(context.WithoutCancel(ctx)) }()
	wctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	select {
	case at := <-free:
		if meshed {
			if err := c.WaitNodeMeshed(wctx, n); err != nil {
				return 0, 0, err
			}
		}
		return at[1].Sub(at[0]), at[1].Sub(began), nil
	case <-wctx.Done():
		return 0, 0, fmt.Errorf("node %s (meshed %v) not free to take pods: %w", name, meshed, wctx.Err())
	}
}

func median(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
