package multinode_test

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/internal/env/demo"
	"github.com/meshcni/meshcni/internal/env/multinode"
	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
)

const (
	// dyingNode is the node TestNodeDies adds and kills.
	dyingNode = "mn-dying"
	// evictAfter is the tolerationSeconds of the dying node's pods for the
	// unreachable and not-ready NoExecute taints: evicted in test time, not 300 s.
	evictAfter = 1
	// dyingReplicas is the Deployment's size.
	dyingReplicas = 2
)

// TestNodeDies: a node the test adds (so the package's nodes stay) runs meshed pods
// of a Deployment, then dies (testbed.Node.Kill: its kubelet, containerd, shims and
// pods SIGKILLed, its link gone). While the controller-manager notices, the
// remaining nodes keep working: meshed pods started on them before the death still
// redirect (app → app captured on 15001 on one side and 15006 on the other), and new
// meshed pods start redirected (istio-validation passes on its first run, the
// redirect their annotations give is in their netns). Once the node is unreachable
// its pods are evicted (tolerationSeconds 1) and the Deployment's replacements,
// scheduled onto the remaining nodes, start redirected and their connections are
// captured. The remaining nodes' taints never change during the whole test (watched
// from its start: meshcni's taint controller does not flap on them), and meshcni's
// DaemonSet is whole again once the dead node is removed.
func TestNodeDies(t *testing.T) {
	c := cluster(t)
	tb := c.TB
	if !tb.Owned() {
		testutil.Missing(t, "TestNodeDies kills a node (testbed.Node.Kill), which needs the test bed this test binary started, not one attached to `hack/testbed up`")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	// Every node meshed and untainted before the watch of their taints starts.
	if err := c.WaitMeshed(ctx); err != nil {
		t.Fatal(err)
	}
	survivors := tb.Nodes()
	var names []string
	for _, n := range survivors {
		names = append(names, n.Name)
	}
	// Every version of every Node from now on: the remaining nodes' must all be free.
	nodeWatch, err := multinode.WatchNodes(ctx, tb.Client, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nodeWatch.Stop)
	watched := time.Now()
	ns := namespace(t, c, "mn-dies")

	dying, err := tb.AddNode(ctx, dyingNode)
	if err != nil {
		t.Fatal(err)
	}
	removed := false
	t.Cleanup(func() {
		if !removed {
			if err := dying.Remove(context.Background()); err != nil {
				t.Errorf("remove node %s: %v", dying.Name, err)
			}
		}
	})
	joined := time.Now()
	wctx, wcancel := context.WithTimeout(ctx, 2*time.Minute)
	defer wcancel()
	if err := c.WaitNodeMeshed(wctx, dying); err != nil {
		t.Fatal(err)
	}
	t.Logf("node %s joined; meshcni in place there (agent Ready, plugin in its chain, untainted) %v after it was Ready",
		dying.Name, time.Since(joined).Round(time.Millisecond))

	if _, err := tb.Client.AppsV1().Deployments(ns).Create(ctx, dyingDeployment(c, ns, "app", dying.Name), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var canaries []*corev1.Pod
	for i, n := range survivors {
		canaries = append(canaries, c.MeshedPod(ns, "before-"+strconv.Itoa(i+1), n.Name))
	}
	started := startPods(ctx, t, tb, canaries...)
	for i := range canaries {
		canaries[i] = started[canaries[i].Name]
	}
	first := deploymentPods(ctx, t, tb, ns, "app", dyingReplicas, nil)
	var onDying []*corev1.Pod
	for _, p := range first {
		redirected(ctx, t, c, p)
		if p.Spec.NodeName == dying.Name {
			onDying = append(onDying, p)
		}
	}
	if len(onDying) == 0 {
		t.Fatalf("no pod of the Deployment landed on %s (preferred by its node affinity)", dying.Name)
	}
	t.Logf("%d of %d meshed pods of Deployment app on %s", len(onDying), dyingReplicas, dying.Name)

	if err := dying.Kill(); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()

	// The remaining nodes keep working while the controller-manager notices.
	for i, c := range canaries {
		meshedPath(ctx, t, tb, c, canaries[(i+1)%len(canaries)])
	}
	var fresh []*corev1.Pod
	for i, n := range survivors {
		fresh = append(fresh, c.MeshedPod(ns, "after-"+strconv.Itoa(i+1), n.Name))
	}
	started = startPods(ctx, t, tb, fresh...)
	for i, p := range fresh {
		p = started[p.Name]
		redirected(ctx, t, c, p)
		meshedPath(ctx, t, tb, p, canaries[(i+1)%len(canaries)])
	}
	t.Logf("%v after %s died: meshed pods on the %d other nodes still redirect, %d new meshed pods started redirected",
		time.Since(killed).Round(time.Millisecond), dying.Name, len(survivors), len(fresh))

	// Its pods are evicted; their replacements start redirected on the others.
	gone := map[string]bool{}
	for _, p := range onDying {
		gone[string(p.UID)] = true
	}
	replacements := deploymentPods(ctx, t, tb, ns, "app", dyingReplicas, func(p *corev1.Pod) error {
		if p.Spec.NodeName == dying.Name {
			return fmt.Errorf("pod %s still on %s", p.Name, dying.Name)
		}
		return nil
	})
	t.Logf("the pods on %s evicted and replaced on the other nodes %v after it died", dying.Name, time.Since(killed).Round(time.Millisecond))
	for _, p := range replacements {
		if gone[string(p.UID)] || !slices.Contains(names, p.Spec.NodeName) {
			t.Errorf("pod %s (uid %s) on %s: want a replacement on a remaining node", p.Name, p.UID, p.Spec.NodeName)
		}
		redirected(ctx, t, c, p)
		meshedPath(ctx, t, tb, p, canaries[0])
	}

	if err := dying.Remove(ctx); err != nil {
		t.Fatalf("remove the dead node %s: %v", dying.Name, err)
	}
	removed = true
	dctx, dcancel := context.WithTimeout(ctx, time.Minute)
	defer dcancel()
	if _, err := tb.WaitDaemonSet(dctx, demo.ReleaseNamespace, "meshcni-agent"); err != nil {
		t.Errorf("meshcni's DaemonSet after %s was removed: %v", dying.Name, err)
	}
	nodeWatch.Stop()
	for _, n := range names {
		states := nodeWatch.States(n)
		if len(states) == 0 {
			t.Errorf("node %s: the watch saw no version of it", n)
		}
		for _, st := range states {
			if !st.Free() {
				t.Errorf("node %s, %v into the test: %s; want it Ready, schedulable and untainted throughout", n, st.At.Sub(watched).Round(time.Millisecond), st)
			}
		}
	}
	t.Logf("%d versions of the %d remaining nodes seen over %v, every one Ready, schedulable and untainted",
		versions(nodeWatch, names), len(names), time.Since(watched).Round(time.Millisecond))
}

func versions(w *multinode.NodeWatch, nodes []string) int {
	n := 0
	for _, name := range nodes {
		n += len(w.States(name))
	}
	return n
}

// dyingDeployment is a Deployment of the demo's meshed pod preferring node, whose
// pods tolerate an unreachable or not-ready node for evictAfter seconds only.
func dyingDeployment(c *multinode.Cluster, ns, name, node string) *appsv1.Deployment {
	p := c.MeshedPod(ns, name, "")
	p.Spec.Affinity = &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{
		PreferredDuringSchedulingIgnoredDuringExecution: []corev1.PreferredSchedulingTerm{{
			Weight: 100,
			Preference: corev1.NodeSelectorTerm{MatchExpressions: []corev1.NodeSelectorRequirement{{
				Key: corev1.LabelHostname, Operator: corev1.NodeSelectorOpIn, Values: []string{node},
			}}},
		}},
	}}
	secs := int64(evictAfter)
	for _, key := range []string{corev1.TaintNodeUnreachable, corev1.TaintNodeNotReady} {
		p.Spec.Tolerations = append(p.Spec.Tolerations, corev1.Toleration{
			Key: key, Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoExecute, TolerationSeconds: &secs,
		})
	}
	replicas := int32(dyingReplicas)
	return &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: appsv1.DeploymentSpec{
			Replicas: &replicas,
			Selector: &metav1.LabelSelector{MatchLabels: p.Labels},
			Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: p.Labels, Annotations: p.Annotations}, Spec: p.Spec},
		},
	}
}

// deploymentPods waits until the Deployment's pods not being deleted are n, each
// Ready with its stand-ins listening and accepted by ok (when set), and returns them.
func deploymentPods(ctx context.Context, t *testing.T, tb *testbed.Testbed, ns, name string, n int, ok func(*corev1.Pod) error) []*corev1.Pod {
	t.Helper()
	var out []*corev1.Pod
	pollUntil(ctx, t, 3*time.Minute, fmt.Sprintf("%d Ready pods of Deployment %s", n, name), func() error {
		l, err := tb.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: multinode.MeshedPodLabel + "=" + name})
		if err != nil {
			return err
		}
		out = out[:0]
		for i := range l.Items {
			p := &l.Items[i]
			if p.DeletionTimestamp != nil {
				continue
			}
			if !multinode.PodReady(p) {
				return fmt.Errorf("pod %s on %q not Ready", p.Name, p.Spec.NodeName)
			}
			if ok != nil {
				if err := ok(p); err != nil {
					return err
				}
			}
			out = append(out, p)
		}
		if len(out) != n {
			return fmt.Errorf("%d pods not being deleted", len(out))
		}
		return nil
	})
	for _, p := range out {
		waitListening(ctx, t, tb, p, demo.AppContainer)
		waitListening(ctx, t, tb, p, demo.ProxyContainer)
	}
	return out
}
