package loadtest_test

import (
	"context"
	"fmt"
	"net/netip"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/suites/loadtest"
	"github.com/meshcni/meshcni/internal/testkit/agenttest"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/capture/k8spod"
	"github.com/meshcni/meshcni/pkg/engine"
)

// envBurst is the number of pods of TestBurst; the figure in docs/performance.md is
// of 100 (the node's maxPods is 110 and nothing else runs on it).
const envBurst = "MESHCNI_LOAD_BURST"

// ciBurst is the number of pods of a burst by default (TestBurst, TestPodFaults).
const ciBurst = 10

const burstNS = "meshcni-burst"

// burstPod is an Istio-injected pod the node really runs: the echo server as the app
// and as istio-proxy (on the excluded port 15021), no readiness probe (kubelet's probe
// of a redirected port would reach a proxy that is not there).
func burstPod(name, phase string) *corev1.Pod {
	p := testbed.EchoPod(name, 0)
	p.Namespace = burstNS
	p.Labels["burst"] = phase
	p.Annotations = map[string]string{capture.AnnotationStatus: `{"containers":["istio-proxy"]}`}
	p.Spec.Containers[0].ReadinessProbe = nil
	no := false
	p.Spec.AutomountServiceAccountToken = &no
	p.Spec.Containers = append(p.Spec.Containers, corev1.Container{
		Name: capture.ProxyContainer, Image: testbed.EchoImage, ImagePullPolicy: corev1.PullNever,
		Env: []corev1.EnvVar{{Name: "PORT", Value: "15021"}},
	})
	return p
}

// burstResult is one burst: when each pod was first seen Ready after the creates began.
type burstResult struct {
	phase string
	ready []time.Duration
	pods  []corev1.Pod
}

func (b burstResult) all() time.Duration { return b.ready[len(b.ready)-1] }

// burst creates n pods at once and waits until all are Ready, polling the list.
func burst(ctx context.Context, t *testing.T, tb *testbed.Testbed, phase string, n int) burstResult {
	t.Helper()
	sel := metav1.ListOptions{LabelSelector: "burst=" + phase}
	began := time.Now()
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := tb.CreatePod(ctx, burstPod(fmt.Sprintf("%s-%03d", phase, i), phase)); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	seen := map[string]time.Duration{}
	var last []corev1.Pod
	for len(seen) < n {
		if ctx.Err() != nil {
			var stuck []string
			for _, p := range last {
				if _, ok := seen[p.Name]; !ok {
					stuck = append(stuck, fmt.Sprintf("%s %s %s", p.Name, p.Status.Phase, p.Status.Message))
				}
			}
			t.Fatalf("%s burst: %d of %d pods Ready: %v; not Ready:\n%s", phase, len(seen), n, ctx.Err(), first(stuck, 10))
		}
		l, err := tb.Client.CoreV1().Pods(burstNS).List(ctx, sel)
		if err == nil {
			now := time.Since(began)
			last = l.Items
			for _, p := range l.Items {
				if _, ok := seen[p.Name]; !ok && podReady(&p) {
					seen[p.Name] = now
				}
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	res := burstResult{phase: phase, pods: last}
	for _, d := range seen {
		res.ready = append(res.ready, d)
	}
	sort.Slice(res.ready, func(i, j int) bool { return res.ready[i] < res.ready[j] })
	return res
}

func podReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
			return true
		}
	}
	return false
}

// deleteBurst deletes a burst's pods and waits until they are gone.
func deleteBurst(ctx context.Context, t *testing.T, tb *testbed.Testbed, phase string) {
	t.Helper()
	zero := int64(0)
	sel := metav1.ListOptions{LabelSelector: "burst=" + phase}
	if err := tb.Client.CoreV1().Pods(burstNS).DeleteCollection(ctx, metav1.DeleteOptions{GracePeriodSeconds: &zero}, sel); err != nil {
		t.Fatal(err)
	}
	for {
		l, err := tb.Client.CoreV1().Pods(burstNS).List(ctx, sel)
		if err == nil && len(l.Items) == 0 {
			return
		}
		if ctx.Err() != nil {
			t.Fatalf("%s burst: pods not gone: %v", phase, ctx.Err())
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// redirected audits a running pod from the node: its netns (found through CRI)
// holds meshcni's rules with no drift, as `meshcnictl inspect` reads them.
func redirected(ctx context.Context, tb *testbed.Testbed, p *corev1.Pod) error {
	netns, err := tb.PodNetns(ctx, p.Namespace, p.Name)
	if err != nil {
		return err
	}
	s, err := capture.Spec(k8spod.From(p))
	if err != nil {
		return err
	}
	var ips []netip.Addr
	for _, ip := range p.Status.PodIPs {
		a, err := netip.ParseAddr(ip.IP)
		if err != nil {
			return err
		}
		ips = append(ips, a)
	}
	capture.WithFamilies(s, ips)
	d, err := engine.Check(ctx, engine.Options{Backend: backend.Auto, NetnsPath: netns}, s)
	if err != nil {
		return err
	}
	if !d.Empty() {
		return fmt.Errorf("drift:\n%s", d)
	}
	return nil
}

// unredirected audits that a pod's netns holds no rule of meshcni's.
func unredirected(ctx context.Context, tb *testbed.Testbed, p *corev1.Pod) error {
	netns, err := tb.PodNetns(ctx, p.Namespace, p.Name)
	if err != nil {
		return err
	}
	l, err := engine.Live(ctx, engine.Options{Backend: backend.Auto, NetnsPath: netns})
	if err != nil {
		return err
	}
	for k, v := range l {
		if strings.TrimSpace(v) != "" {
			return fmt.Errorf("%s rules:\n%s", k, v)
		}
	}
	return nil
}

func stats(round int, b burstResult) string {
	p50, p99, _ := loadtest.Percentiles(b.ready)
	return fmt.Sprintf("| %d | %s | %d | %.1f s | %.1f s | %.1f s | %.1f s |", round, b.phase, len(b.ready),
		b.ready[0].Seconds(), p50.Seconds(), p99.Seconds(), b.all().Seconds())
}

// envBurstRounds is the number of plain/meshed burst pairs of TestBurst.
const envBurstRounds = "MESHCNI_LOAD_BURST_ROUNDS"

// TestBurst: n meshed pods created at once on the node, with the test bed's chain
// alone and then with meshcni chained by the real agent (after a warm-up burst, in
// rounds): every pod Running, the meshed ones redirected and the plain ones not
// (audited in their netns), and the time to all Ready of each burst logged with the
// ratio (a measurement, not an assertion).
func TestBurst(t *testing.T) {
	n, err := loadtest.Count(envBurst, ciBurst)
	if err != nil {
		t.Fatal(err)
	}
	rounds, err := loadtest.Count(envBurstRounds, 1)
	if err != nil {
		t.Fatal(err)
	}
	tb := testbed.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	if err := ensureNamespace(ctx, tb, burstNS); err != nil {
		t.Fatal(err)
	}
	run := func(phase string, n int) burstResult {
		bctx, bcancel := context.WithTimeout(ctx, 5*time.Minute)
		defer bcancel()
		return burst(bctx, t, tb, phase, n)
	}
	// Warm-up: the first burst after the node's start pays for cold caches.
	run("warmup", max(n/5, 5))
	deleteBurst(ctx, t, tb, "warmup")

	var rows []string
	var plainSum, meshSum float64
	for round := 1; round <= rounds; round++ {
		base := run("plain", n)
		for _, p := range base.pods {
			if err := unredirected(ctx, tb, &p); err != nil {
				t.Fatalf("pod %s without meshcni in the chain: %v", p.Name, err)
			}
		}
		deleteBurst(ctx, t, tb, "plain")

		a := agenttest.Start(t, agenttest.Options{})
		mesh := run("meshed", n)
		var bad []string
		for _, p := range mesh.pods {
			if p.Status.Phase != corev1.PodRunning {
				bad = append(bad, fmt.Sprintf("%s: phase %s", p.Name, p.Status.Phase))
			} else if err := redirected(ctx, tb, &p); err != nil {
				bad = append(bad, fmt.Sprintf("%s: %v", p.Name, err))
			}
		}
		if len(bad) > 0 {
			t.Errorf("round %d: %d of %d pods not Running and redirected:\n%s", round, len(bad), n, first(bad, 10))
		}
		deleteBurst(ctx, t, tb, "meshed")
		if errs, total := pluginErrors(a.Metrics(t)); errs > 0 {
			t.Errorf("round %d: the agent counted %v failed plugin commands of %v", round, errs, total)
		}
		if err := a.Stop(); err != nil {
			t.Fatal(err)
		}
		rows = append(rows, stats(round, base), stats(round, mesh))
		plainSum += base.all().Seconds()
		meshSum += mesh.all().Seconds()
	}
	t.Logf("burst of %d pods created at once, time from the first create until each pod is Ready:\n"+
		"| round | chain | pods | first Ready | p50 | p99 | all Ready |\n|---|---|---|---|---|---|---|\n%s\n"+
		"all Ready with meshcni / without (sum over %d rounds): %.2f",
		n, strings.Join(rows, "\n"), rounds, meshSum/plainSum)
}

// envPodRounds is the number of rounds of TestPodFaults.
const envPodRounds = "MESHCNI_LOAD_POD_ROUNDS"

// TestPodFaults: on the full node with meshcni chained by the real agent, rounds of
// pods created at once while, a moment later, containerd or the API server (in
// turn) restarts under them: kubelet retries what failed, and every pod that runs is
// redirected (audited in its netns); no pod ever runs unredirected.
func TestPodFaults(t *testing.T) {
	rounds, err := loadtest.Count(envPodRounds, 2)
	if err != nil {
		t.Fatal(err)
	}
	n, err := loadtest.Count(envBurst, ciBurst)
	if err != nil {
		t.Fatal(err)
	}
	n = min(n, 20)
	tb := testbed.Shared(t)
	if !tb.Owned() {
		testutil.Missing(t, "the test bed is attached (hack/testbed up): its components cannot be restarted from here")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	if err := ensureNamespace(ctx, tb, burstNS); err != nil {
		t.Fatal(err)
	}
	a := agenttest.Start(t, agenttest.Options{})
	faults := []string{"containerd", "kube-apiserver"}
	for round := 0; round < rounds; round++ {
		fault := faults[round%len(faults)]
		phase := fmt.Sprintf("fault%d", round)
		restarted := make(chan error, 1)
		go func() {
			time.Sleep(time.Second)
			began := time.Now()
			err := tb.Restart(ctx, fault)
			t.Logf("round %d: %s restarted in %v (%v)", round, fault, time.Since(began).Round(time.Millisecond), err)
			restarted <- err
		}()
		bctx, bcancel := context.WithTimeout(ctx, 6*time.Minute)
		res := burst(bctx, t, tb, phase, n)
		bcancel()
		if err := <-restarted; err != nil {
			t.Fatalf("restart %s: %v", fault, err)
		}
		var bad []string
		for _, p := range res.pods {
			if err := redirected(ctx, tb, &p); err != nil {
				bad = append(bad, fmt.Sprintf("%s: %v", p.Name, err))
			}
		}
		if len(bad) > 0 {
			t.Errorf("round %d (%s restarted): %d of %d running pods not redirected:\n%s", round, fault, len(bad), n, first(bad, 10))
		}
		t.Logf("round %d: %d pods created at once, %s restarted 1 s later: all Ready after %.1f s, all redirected: %v",
			round, n, fault, res.all().Seconds(), len(bad) == 0)
		deleteBurst(ctx, t, tb, phase)
	}
	if err := a.WaitReady(ctx); err != nil {
		t.Errorf("the agent after the faults: %v", err)
	}
}
