package multinode_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/meshcni/meshcni/internal/env/demo"
	"github.com/meshcni/meshcni/internal/env/multinode"
	"github.com/meshcni/meshcni/pkg/taint"
)

const (
	// breakerJoinNode is the node TestBreakerThreeNodes adds (and removes).
	breakerJoinNode = "mn-brk-join"
	// taintDeployment is the release's taint controller.
	taintDeployment = "meshcni-taint-controller"
	// taintPodSelector selects its pods.
	taintPodSelector = "app.kubernetes.io/instance=" + demo.Release + ",app.kubernetes.io/component=taint-controller"
	// brokenImage is an agent image no node holds (pullPolicy Never: ErrImageNeverPull).
	brokenImage = "meshcni.local/meshcni:broken"
)

// taintCensus follows, from a node watch, which nodes carry the taint and the most that
// did at once.
type taintCensus struct {
	mu      sync.Mutex
	tainted map[string]bool
	most    int
	seen    map[string]bool // nodes that carried it at any time
}

func (tc *taintCensus) observe(name string, s multinode.NodeState) {
	tc.mu.Lock()
	defer tc.mu.Unlock()
	tc.tainted[name] = !s.Deleted && s.Tainted(demo.NotReadyTaint)
	if tc.tainted[name] {
		tc.seen[name] = true
	}
	n := 0
	for _, t := range tc.tainted {
		if t {
			n++
		}
	}
	tc.most = max(tc.most, n)
}

func (tc *taintCensus) now() (tainted []string, most int) {
	tc.mu.Lock()
	defer tc.mu.Unlock()
	for n, t := range tc.tainted {
		if t {
			tainted = append(tainted, n)
		}
	}
	return tainted, tc.most
}

// TestBreakerThreeNodes is the breaker on the real cluster: the taint controller set to
// --taint-mode=always (so that agents that were Ready count), every agent broken at
// once (its DaemonSet's image replaced by one no node holds, all pods at once) → past
// the grace period exactly one node of three carries the taint (the limit with the
// chart's defaults: max(1, ⌊0.1 × 3⌋)), never more, and the controller reports the
// breaker once (a TaintBreakerOpen Warning Event, one log line); the image restored →
// every taint removed; a fourth node joining is tainted and freed once its agent is
// Ready. The DaemonSet and the controller are restored at the end.
func TestBreakerThreeNodes(t *testing.T) {
	c := cluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	cs := c.TB.Client
	began := time.Now()
	dsets := cs.AppsV1().DaemonSets(demo.ReleaseNamespace)
	deps := cs.AppsV1().Deployments(demo.ReleaseNamespace)
	dl, err := dsets.List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/instance=" + demo.Release})
	if err != nil || len(dl.Items) != 1 {
		t.Fatalf("the release's DaemonSet: %v (%d)", err, len(dl.Items))
	}
	ds0 := dl.Items[0].DeepCopy()
	dep0, err := deps.Get(ctx, taintDeployment, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	restored := false
	restore := func() {
		if restored {
			return
		}
		restored = true
		rctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		if err := update(rctx, c, ds0.Name, func(ds *appsv1.DaemonSet) {
			ds.Spec.Template, ds.Spec.UpdateStrategy = ds0.Spec.Template, ds0.Spec.UpdateStrategy
		}); err != nil {
			t.Errorf("restore the DaemonSet: %v", err)
		}
		if err := c.WaitRolledOut(rctx); err != nil {
			t.Errorf("the restored DaemonSet: %v", err)
		}
		if err := c.WaitMeshed(rctx); err != nil {
			t.Errorf("nodes meshed again: %v", err)
		}
	}
	t.Cleanup(func() {
		restore()
		rctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		if err := updateDeployment(rctx, c, func(d *appsv1.Deployment) { d.Spec.Template = dep0.Spec.Template }); err != nil {
			t.Errorf("restore the taint controller: %v", err)
		}
	})

	// The controller in always mode; it restarts and takes the Lease.
	if err := updateDeployment(ctx, c, func(d *appsv1.Deployment) {
		setEnv(&d.Spec.Template.Spec.Containers[0], "MESHCNI_TAINT_MODE", "always")
	}); err != nil {
		t.Fatal(err)
	}
	ctrl, err := taintPod(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("taint controller %s in --taint-mode=always", ctrl)

	census := &taintCensus{tainted: map[string]bool{}, seen: map[string]bool{}}
	w, err := multinode.WatchNodes(ctx, cs, census.observe)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()

	// Every agent broken at once.
	broke := time.Now()
	if err := update(ctx, c, ds0.Name, func(ds *appsv1.DaemonSet) {
		all := intstr.FromString("100%")
		ds.Spec.UpdateStrategy = appsv1.DaemonSetUpdateStrategy{Type: appsv1.RollingUpdateDaemonSetStrategyType,
			RollingUpdate: &appsv1.RollingUpdateDaemonSet{MaxUnavailable: &all, MaxSurge: ptrTo(intstr.FromInt32(0))}}
		ds.Spec.Template.Spec.Containers[0].Image = brokenImage
	}); err != nil {
		t.Fatal(err)
	}
	nodes, err := c.MeshedNodes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pollUntil(ctx, t, 2*time.Minute, "every agent pod of the broken image, none Ready", func() error {
		for _, n := range nodes {
			pods, err := c.AgentPods(ctx, n.Name)
			if err != nil {
				return err
			}
			for _, p := range pods {
				if p.Spec.Containers[0].Image != brokenImage || multinode.PodReady(&p) {
					return fmt.Errorf("node %s: agent pod %s image %s ready %v", n.Name, p.Name, p.Spec.Containers[0].Image, multinode.PodReady(&p))
				}
			}
			if len(pods) == 0 {
				return fmt.Errorf("node %s: no agent pod", n.Name)
			}
		}
		return nil
	})
	limit := taint.Limit(len(nodes), 0.1, 1)
	pollUntil(ctx, t, time.Minute, fmt.Sprintf("%d node tainted", limit), func() error {
		if got, _ := census.now(); len(got) != limit {
			return fmt.Errorf("tainted %v", got)
		}
		return nil
	})
	// Two more grace periods (10 s each): nothing more.
	time.Sleep(25 * time.Second)
	got, most := census.now()
	t.Logf("%d agents broken %s ago: tainted %v (at most %d at once, limit %d of %d)", len(nodes), time.Since(broke).Round(time.Second), got, most, limit, len(nodes))
	if len(got) != limit || most != limit {
		t.Fatalf("tainted %v, at most %d at once; want exactly %d", got, most, limit)
	}
	pollUntil(ctx, t, 30*time.Second, "one TaintBreakerOpen Event", func() error {
		if n := breakerEvents(ctx, c, taint.ReasonBreakerOpen, began); n != 1 {
			return fmt.Errorf("%d Events", n)
		}
		return nil
	})
	logs, err := c.TB.PodLogs(ctx, demo.ReleaseNamespace, ctrl, "")
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(logs, taint.LogBreakerOpen); n != 1 {
		t.Errorf("the controller logged %q %d times, want once", taint.LogBreakerOpen, n)
	}

	// The agents recover: every taint goes.
	restore()
	pollUntil(ctx, t, time.Minute, "no node tainted", func() error {
		if got, _ := census.now(); len(got) != 0 {
			return fmt.Errorf("tainted %v", got)
		}
		return nil
	})
	pollUntil(ctx, t, 30*time.Second, "one TaintBreakerClosed Event", func() error {
		if n := breakerEvents(ctx, c, taint.ReasonBreakerClosed, began); n != 1 {
			return fmt.Errorf("%d Events", n)
		}
		return nil
	})

	// A node joining still gets the taint, and loses it once meshed.
	n, err := c.TB.AddNode(ctx, breakerJoinNode)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { removeNode(t, c, n, "", "") })
	if err := c.WaitNodeMeshed(ctx, n); err != nil {
		t.Fatal(err)
	}
	pollUntil(ctx, t, 30*time.Second, breakerJoinNode+" untainted", func() error {
		census.mu.Lock()
		defer census.mu.Unlock()
		if census.tainted[breakerJoinNode] {
			return fmt.Errorf("still tainted")
		}
		return nil
	})
	census.mu.Lock()
	joined := census.seen[breakerJoinNode]
	census.mu.Unlock()
	if !joined {
		t.Errorf("the joining node %s was never tainted: %v", breakerJoinNode, w.States(breakerJoinNode))
	}
}

func ptrTo[T any](v T) *T { return &v }

func setEnv(ct *corev1.Container, name, value string) {
	for i := range ct.Env {
		if ct.Env[i].Name == name {
			ct.Env[i] = corev1.EnvVar{Name: name, Value: value}
			return
		}
	}
	ct.Env = append(ct.Env, corev1.EnvVar{Name: name, Value: value})
}

// update changes the release's DaemonSet (retrying on conflicts).
func update(ctx context.Context, c *multinode.Cluster, name string, change func(*appsv1.DaemonSet)) error {
	for {
		ds, err := c.TB.Client.AppsV1().DaemonSets(demo.ReleaseNamespace).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		change(ds)
		if _, err = c.TB.Client.AppsV1().DaemonSets(demo.ReleaseNamespace).Update(ctx, ds, metav1.UpdateOptions{}); err == nil {
			return nil
		} else if ctx.Err() != nil {
			return err
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// updateDeployment changes the taint controller's Deployment and waits until its one
// pod of the new template is Ready and no other remains.
func updateDeployment(ctx context.Context, c *multinode.Cluster, change func(*appsv1.Deployment)) error {
	deps := c.TB.Client.AppsV1().Deployments(demo.ReleaseNamespace)
	for {
		d, err := deps.Get(ctx, taintDeployment, metav1.GetOptions{})
		if err != nil {
			return err
		}
		change(d)
		if _, err = deps.Update(ctx, d, metav1.UpdateOptions{}); err == nil {
			break
		} else if ctx.Err() != nil {
			return err
		}
		time.Sleep(100 * time.Millisecond)
	}
	for {
		d, err := deps.Get(ctx, taintDeployment, metav1.GetOptions{})
		if err != nil {
			return err
		}
		want := *d.Spec.Replicas
		if d.Status.ObservedGeneration >= d.Generation && d.Status.UpdatedReplicas == want &&
			d.Status.ReadyReplicas == want && d.Status.Replicas == want {
			if _, err := taintPod(ctx, c); err == nil {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("taint controller rollout: %+v: %w", d.Status, ctx.Err())
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// taintPod is the taint controller's one Ready pod that is not terminating.
func taintPod(ctx context.Context, c *multinode.Cluster) (string, error) {
	l, err := c.TB.Client.CoreV1().Pods(demo.ReleaseNamespace).List(ctx, metav1.ListOptions{LabelSelector: taintPodSelector})
	if err != nil {
		return "", err
	}
	var ready []string
	for i := range l.Items {
		if multinode.PodReady(&l.Items[i]) && l.Items[i].DeletionTimestamp == nil {
			ready = append(ready, l.Items[i].Name)
		}
	}
	if len(ready) != 1 || len(l.Items) != 1 {
		return "", fmt.Errorf("taint controller pods: %d, %d Ready", len(l.Items), len(ready))
	}
	return ready[0], nil
}

// breakerEvents counts the taint controller's Events with reason on nodes since.
func breakerEvents(ctx context.Context, c *multinode.Cluster, reason string, since time.Time) int {
	l, err := c.TB.Client.CoreV1().Events("default").List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.kind=Node,reason=" + reason})
	if err != nil {
		return -1
	}
	n := 0
	for _, ev := range l.Items {
		if ev.Source.Component == taint.Component && !ev.LastTimestamp.Time.Before(since.Truncate(time.Second)) {
			n += max(int(ev.Count), 1)
		}
	}
	return n
}
