package multinode_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/meshcni/meshcni/internal/env/multinode"
	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/tools/build/image"
)

// upgradeTag is the tag TestRollingUpgrade upgrades to: the same build.
const upgradeTag = image.DefaultTag + "-upgrade"

// window is a node's agent rollout as the recorder saw it: from the first moment
// its old agent pod was terminating or gone to the first moment a new one was
// Ready.
type window struct{ start, end time.Time }

// creation is one Create call of the loop: the pod came to exist between sent and done.
type creation struct{ sent, done time.Time }

// holds reports whether the pod of cr came to exist inside the window.
func (w *window) holds(cr creation) bool {
	return !w.start.IsZero() && !w.end.IsZero() && !cr.sent.Before(w.start) && !cr.done.After(w.end)
}

// rollout samples, every 100 ms, each node's agent pods and its conflist.
type rollout struct {
	c     *multinode.Cluster
	nodes []*testbed.Node
	old   map[string]map[types.UID]bool // node → agent pods before the upgrade

	mu      sync.Mutex
	windows map[string]*window
	bad     []string // conflist samples that were not exactly one valid entry
	samples int
}

func newRollout(ctx context.Context, c *multinode.Cluster, nodes []*testbed.Node) (*rollout, error) {
	r := &rollout{c: c, nodes: nodes, old: map[string]map[types.UID]bool{}, windows: map[string]*window{}}
	for _, n := range nodes {
		pods, err := c.AgentPods(ctx, n.Name)
		if err != nil {
			return nil, err
		}
		r.old[n.Name] = map[types.UID]bool{}
		for _, p := range pods {
			r.old[n.Name][p.UID] = true
		}
		r.windows[n.Name] = &window{}
	}
	return r, nil
}

func (r *rollout) sample(ctx context.Context, n *testbed.Node) {
	st := r.c.Plugin(n)
	pods, err := r.c.AgentPods(ctx, n.Name)
	now := time.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	r.samples++
	if st.Err != nil || st.Entries != 1 {
		r.bad = append(r.bad, fmt.Sprintf("%s at %s: %s", n.Name, now.Format("15:04:05.000"), st))
	}
	if err != nil {
		return
	}
	w, oldLeft, newReady := r.windows[n.Name], 0, false
	for i := range pods {
		p := &pods[i]
		switch {
		case r.old[n.Name][p.UID] && p.DeletionTimestamp == nil:
			oldLeft++
		case !r.old[n.Name][p.UID] && multinode.PodReady(p):
			newReady = true
		}
	}
	if w.start.IsZero() && oldLeft == 0 {
		w.start = now
	}
	if w.end.IsZero() && newReady {
		w.end = now
	}
}

// opening returns a node whose agent rollout is under way and on which none of the
// created pods came to exist since it began, else nil.
func (r *rollout) opening(created map[string][]creation) *testbed.Node {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, n := range r.nodes {
		w := r.windows[n.Name]
		if w.start.IsZero() || !w.end.IsZero() {
			continue
		}
		if !slices.ContainsFunc(created[n.Name], func(cr creation) bool { return !cr.sent.Before(w.start) }) {
			return n
		}
	}
	return nil
}

// run samples every node every 100 ms until ctx ends.
func (r *rollout) run(ctx context.Context) {
	for {
		var wg sync.WaitGroup
		for _, n := range r.nodes {
			wg.Go(func() { r.sample(ctx, n) })
		}
		wg.Wait()
		select {
		case <-ctx.Done():
			return
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// TestRollingUpgrade is the proof that `helm upgrade` to a new image tag rolls
// meshcni over the nodes without a pod starting unredirected. The same build is
// made under a second tag and imported into every node; while a loop creates a
// meshed pod every 700 ms, on each node in turn (and on a node at once when its
// agent's rollout begins), the release is upgraded to it and rolls out node by node.
// On every node at least one of the loop's pods came to exist inside that node's
// agent rollout (from the old agent pod terminating to the new one Ready). Sampled
// every 100 ms on every node during the rollout, the conflist is always valid with
// exactly one meshcni entry (the agent keeps its entry over an upgrade). Every pod
// of the loop started redirected (audited from its node); a failed sandbox creation
// (FailedCreatePodSandBox) on a node happened only within its own node's agent
// rollout (±1 s for the events' second precision); after the upgrade every node runs
// an agent of the new tag and is meshed.
func TestRollingUpgrade(t *testing.T) {
	c := cluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	ns := namespace(t, c, "mn-upgrade")
	ref, err := c.BuildTag(ctx, upgradeTag)
	if err != nil {
		t.Fatal(err)
	}
	nodes := c.TB.Nodes()
	ro, err := newRollout(ctx, c, nodes)
	if err != nil {
		t.Fatal(err)
	}
	sctx, stopSampling := context.WithCancel(ctx)
	var bg sync.WaitGroup
	bg.Go(func() { ro.run(sctx) })

	lctx, stopLoop := context.WithCancel(ctx)
	var created []string
	createdAt := map[string][]creation{} // node → the loop's creates of pods there
	var createErr error
	bg.Go(func() {
		turn := 0
		for i := 0; lctx.Err() == nil && i < 60; i++ {
			n := ro.opening(createdAt)
			if n == nil {
				n = nodes[turn%len(nodes)]
				turn++
			}
			p := c.MeshedPod(ns, fmt.Sprintf("p%02d", i), n.Name)
			sent := time.Now()
			if _, err := c.TB.Client.CoreV1().Pods(ns).Create(lctx, p, metav1.CreateOptions{}); err != nil {
				if lctx.Err() == nil {
					createErr = err
				}
				return
			}
			created = append(created, p.Name)
			createdAt[n.Name] = append(createdAt[n.Name], creation{sent: sent, done: time.Now()})
			// 700 ms to the next pod, or less when a node's rollout begins.
			for range 7 {
				if ro.opening(createdAt) != nil {
					break
				}
				select {
				case <-lctx.Done():
				case <-time.After(100 * time.Millisecond):
				}
			}
		}
	})

	time.Sleep(time.Second) // pods created before the rollout too
	began := time.Now()
	err = c.Upgrade(ctx, "--set-string", "tag="+upgradeTag)
	took := time.Since(began)
	time.Sleep(time.Second) // and after it
	stopLoop()
	stopSampling()
	bg.Wait()
	if err != nil {
		t.Fatalf("helm upgrade to %s: %v", ref, err)
	}
	if createErr != nil {
		t.Fatalf("create pods: %v", createErr)
	}
	t.Logf("helm upgrade to %s: rolled out and every node meshed after %s; %d pods created meanwhile", ref, took.Round(time.Millisecond), len(created))

	ro.mu.Lock()
	for _, n := range nodes {
		w := ro.windows[n.Name]
		during := 0
		for _, cr := range createdAt[n.Name] {
			if w.holds(cr) {
				during++
			}
		}
		t.Logf("node %s: agent rollout %s .. %s (%s), %d pods created there meanwhile", n.Name,
			w.start.Format("15:04:05.000"), w.end.Format("15:04:05.000"), w.end.Sub(w.start).Round(time.Millisecond), during)
		switch {
		case w.start.IsZero() || w.end.IsZero():
			t.Errorf("node %s: no rollout of its agent seen (start %v, end %v)", n.Name, w.start, w.end)
		case during == 0:
			t.Errorf("node %s: no pod of the loop created there during its agent rollout %s .. %s: the proof needs one",
				n.Name, w.start.Format("15:04:05.000"), w.end.Format("15:04:05.000"))
		}
	}
	t.Logf("%d conflist samples", ro.samples)
	if len(ro.bad) > 0 {
		t.Errorf("conflist not exactly one valid meshcni entry during the rollout (%d samples):\n  %s", len(ro.bad), strings.Join(ro.bad, "\n  "))
	}
	ro.mu.Unlock()

	pods := make([]*corev1.Pod, len(created))
	errs := make([]error, len(created))
	var wg sync.WaitGroup
	for i, name := range created {
		wg.Go(func() {
			p, err := c.TB.WaitPodReady(ctx, ns, name)
			if err == nil {
				pods[i], err = p, c.Redirected(ctx, p)
			}
			errs[i] = err
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
	checkSandboxFailures(ctx, t, c, ns, pods, ro.windows)

	for _, n := range nodes {
		p, err := c.AgentPod(ctx, n.Name)
		if err != nil {
			t.Error(err)
			continue
		}
		if img := p.Spec.Containers[0].Image; img != ref {
			t.Errorf("agent pod %s on %s runs %s, want %s", p.Name, n.Name, img, ref)
		}
	}
}

// checkSandboxFailures fails the test for each FailedCreatePodSandBox event of a
// pod outside its node's rollout window (±1 s).
func checkSandboxFailures(ctx context.Context, t *testing.T, c *multinode.Cluster, ns string, pods []*corev1.Pod, windows map[string]*window) {
	t.Helper()
	node := map[string]string{}
	for _, p := range pods {
		if p != nil {
			node[p.Name] = p.Spec.NodeName
		}
	}
	evs, err := c.TB.Client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "reason=FailedCreatePodSandBox"})
	if err != nil {
		t.Fatal(err)
	}
	perNode := map[string]int{}
	for _, ev := range evs.Items {
		n := node[ev.InvolvedObject.Name]
		w := windows[n]
		perNode[n] += int(max(ev.Count, 1))
		first, last := ev.FirstTimestamp.Time, ev.LastTimestamp.Time
		if first.IsZero() {
			first, last = ev.EventTime.Time, ev.EventTime.Time
		}
		if w == nil || w.start.IsZero() || w.end.IsZero() ||
			first.Before(w.start.Truncate(time.Second).Add(-time.Second)) || last.After(w.end.Add(time.Second)) {
			t.Errorf("pod %s on %s: sandbox creation failed %s .. %s, outside its node's agent rollout %+v: %s",
				ev.InvolvedObject.Name, n, first.Format("15:04:05"), last.Format("15:04:05"), w, ev.Message)
		}
	}
	t.Logf("FailedCreatePodSandBox events per node: %v", perNode)
}
