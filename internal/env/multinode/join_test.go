package multinode_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/meshcni/meshcni/internal/env/demo"
	"github.com/meshcni/meshcni/internal/env/multinode"
	"github.com/meshcni/meshcni/internal/env/testbed"
)

// joinNode is the node TestNodeJoin adds (and removes).
const joinNode = "mn-join"

// joinTimeline is what TestNodeJoin saw of the joining node, each time the
// moment the node watch received the version (or the poll saw the file).
type joinTimeline struct {
	mu                                             sync.Mutex
	created, tainted, ready, untainted, free, plug time.Time
	taintedAtReady                                 bool
	// atFree is what NodeMeshed said when the node was first free to take any
	// pod: nil when meshcni was in place at that moment.
	atFree    error
	freeState multinode.NodeState
}

func (j *joinTimeline) since(t time.Time) string {
	if t.IsZero() {
		return "never"
	}
	return "+" + t.Sub(j.created).Round(time.Millisecond).String()
}

// observe records a version of the joining node; at its first free version it
// checks, at once, that meshcni is in place there.
func (j *joinTimeline) observe(ctx context.Context, c *multinode.Cluster, s multinode.NodeState, onCreate func()) {
	j.mu.Lock()
	defer j.mu.Unlock()
	if s.Deleted {
		return
	}
	if j.created.IsZero() {
		j.created = s.At
		onCreate()
	}
	ours := s.Tainted(demo.NotReadyTaint)
	if j.tainted.IsZero() && ours {
		j.tainted = s.At
	}
	if j.ready.IsZero() && s.Ready {
		j.ready, j.taintedAtReady = s.At, ours
	}
	if !j.tainted.IsZero() && j.untainted.IsZero() && !ours {
		j.untainted = s.At
	}
	if j.free.IsZero() && s.Free() {
		j.free, j.freeState = s.At, s
		n, err := c.TB.Node(joinNode)
		if err == nil {
			err = c.NodeMeshed(ctx, n)
		}
		j.atFree = err
	}
}

// TestNodeJoin is the proof that a node joining a running meshed cluster never
// takes a meshed pod before meshcni is in place there. A Deployment of meshed
// pods (spread over the nodes, at most one more on any node than on the
// emptiest) is scaled up the moment the new node's Node object appears. Watching
// the Node from its creation: the taint controller taints it, before it turns
// Ready; when the node is first free to take a pod (Ready, no NoSchedule or
// NoExecute taint), meshcni's agent pod there is Ready, the plugin binary is in
// the node's CNI bin directory and its conflist holds exactly one meshcni entry
// (checked at that moment); every pod of the Deployment, on every node, started
// redirected (audited from its node: the istio-validation init container passed
// on its first run, meshcni's rules in sync); at least one landed on the new node;
// none was replaced. The node is removed at the end.
func TestNodeJoin(t *testing.T) {
	c := cluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	ns := namespace(t, c, "mn-join")
	const replicas = 2 * (Nodes + 1)
	deps := c.TB.Client.AppsV1().Deployments(ns)
	if _, err := deps.Create(ctx, c.MeshedDeployment(ns, "web", 0), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	j := &joinTimeline{}
	scaled := make(chan error, 1)
	scale := func() {
		go func() {
			patch := fmt.Appendf(nil, `{"spec":{"replicas":%d}}`, replicas)
			_, err := deps.Patch(ctx, "web", types.MergePatchType, patch, metav1.PatchOptions{})
			scaled <- err
		}()
	}
	w, err := multinode.WatchNodes(ctx, c.TB.Client, func(name string, s multinode.NodeState) {
		if name == joinNode {
			j.observe(ctx, c, s, scale)
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	stopPoll := pollPlugin(c, joinNode, &j.mu, &j.plug)

	began := time.Now()
	n, err := c.TB.AddNode(ctx, joinNode)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { removeNode(t, c, n, ns, "web") })
	t.Logf("AddNode %s returned after %s (containerd start to Ready %s)", joinNode, time.Since(began).Round(time.Millisecond), n.StartupTime.Round(time.Millisecond))
	if err := c.WaitNodeMeshed(ctx, n); err != nil {
		t.Fatal(err)
	}
	stopPoll()
	// The node lifecycle controller may have put its own node.kubernetes.io/not-ready
	// NoExecute taint on the node before it turned Ready; it lifts it on its next
	// pass (every 5 s). The node is free only then.
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(pollEvery) {
		j.mu.Lock()
		free := !j.free.IsZero()
		j.mu.Unlock()
		if free {
			break
		}
	}
	if err := <-scaled; err != nil {
		t.Fatalf("scale the Deployment at the join: %v", err)
	}

	j.mu.Lock()
	t.Logf("node %s: created, tainted %s, Ready %s (tainted then: %v), plugin in its conflist %s, untainted %s, free %s",
		joinNode, j.since(j.tainted), j.since(j.ready), j.taintedAtReady, j.since(j.plug), j.since(j.untainted), j.since(j.free))
	switch {
	case j.tainted.IsZero():
		t.Errorf("the taint controller never tainted %s: %v", joinNode, w.States(joinNode))
	case j.free.IsZero():
		t.Errorf("node %s never free to take pods: %v", joinNode, w.States(joinNode))
	case j.free.Before(j.tainted):
		t.Errorf("node %s was free (%s) before the taint controller tainted it", joinNode, j.freeState)
	case j.atFree != nil:
		t.Errorf("node %s free to take pods before meshcni was in place: %v", joinNode, j.atFree)
	}
	if !j.taintedAtReady {
		t.Errorf("node %s turned Ready without the %s taint", joinNode, demo.NotReadyTaint)
	}
	j.mu.Unlock()

	pods := waitDeploymentPods(ctx, t, c, ns, "web", replicas)
	onNew := 0
	errs := make([]error, len(pods))
	var wg sync.WaitGroup
	for i := range pods {
		if pods[i].Spec.NodeName == joinNode {
			onNew++
		}
		wg.Go(func() { errs[i] = c.Redirected(ctx, &pods[i]) })
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
	if onNew == 0 {
		t.Errorf("no pod of the Deployment landed on %s; the join proves nothing about it", joinNode)
	}
	t.Logf("%d pods of the Deployment audited from their nodes, %d of them on %s", len(pods), onNew, joinNode)
}

// pollPlugin records in *at (under mu) when the node's conflist first holds
// meshcni's entry and its bin directory the plugin, polling every 100 ms; the
// returned func stops it.
func pollPlugin(c *multinode.Cluster, node string, mu *sync.Mutex, at *time.Time) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			if n, err := c.TB.Node(node); err == nil {
				if st := c.Plugin(n); st.Binary && st.Entries == 1 {
					mu.Lock()
					*at = time.Now()
					mu.Unlock()
					return
				}
			}
			select {
			case <-done:
				return
			case <-time.After(100 * time.Millisecond):
			}
		}
	})
	return func() { close(done); wg.Wait() }
}

// waitDeploymentPods waits until the Deployment has want Ready pods and no other,
// and fails the test if a pod it saw meanwhile was replaced (deleted: a pod that
// failed, or that the repair controller removed).
func waitDeploymentPods(ctx context.Context, t *testing.T, c *multinode.Cluster, ns, name string, want int) []corev1.Pod {
	t.Helper()
	seen := map[types.UID]string{}
	for {
		l, err := c.TB.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: multinode.MeshedPodLabel + "=" + name})
		if err != nil {
			t.Fatal(err)
		}
		now := map[types.UID]bool{}
		ready := 0
		for i := range l.Items {
			p := &l.Items[i]
			seen[p.UID], now[p.UID] = p.Name+" on "+p.Spec.NodeName, true
			if multinode.PodReady(p) {
				ready++
			}
		}
		for uid, what := range seen {
			if !now[uid] {
				t.Fatalf("pod %s of Deployment %s was replaced (deleted before the end)", what, name)
			}
		}
		if ready == want && len(l.Items) == want {
			return l.Items
		}
		select {
		case <-ctx.Done():
			t.Fatalf("Deployment %s: %d of %d pods Ready (%d pods): %v", name, ready, want, len(l.Items), ctx.Err())
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// removeNode deletes the Deployment (so its pods are not rescheduled during the
// drain) and removes the node, leaving the package cluster as it was.
func removeNode(t *testing.T, c *multinode.Cluster, n *testbed.Node, ns, deployment string) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if deployment != "" {
		_ = c.TB.Client.AppsV1().Deployments(ns).Delete(ctx, deployment, metav1.DeleteOptions{})
	}
	if err := n.Remove(ctx); err != nil {
		t.Errorf("remove node %s: %v", n.Name, err)
	}
}
