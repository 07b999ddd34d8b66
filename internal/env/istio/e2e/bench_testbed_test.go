package e2e

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/meshcni/meshcni/internal/env/istio"
	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
)

const benchNamespace = "istio-bench"

// startArm is one way of meshing the benchmark's pod: the pod as Istio's injector
// rendered it, and its init container ("" for none but the istio-proxy sidecar).
type startArm struct {
	name, init string
	pod        *corev1.Pod
	ready      []time.Duration // create → Ready, per pod
	proxyUp    []time.Duration // create → istio-proxy running, per pod
	initRun    []time.Duration // the init container's first to last log line, per pod
}

// BenchmarkPodStart measures pod start (create → Ready) of a meshed pod under the
// real Istio in three arms: meshcni's redirect with the injector's CNI mode
// (istio-validation), meshcni's redirect validation-free (the CNI mode plus the
// shipped meshcni-validation-free template: no init container but the istio-proxy
// sidecar), and Istio's privileged istio-init (non-CNI mode: pilot-agent
// istio-iptables writes the rules as root with NET_ADMIN/NET_RAW, using the iptables
// in the proxyv2 image), on the same node and istiod, interleaved: each round starts
// one pod of each arm, one at a time, the first arm rotating between rounds; every
// pod is deleted (and gone) before the next one is created. b.N is the number of pods
// per arm (-benchtime 20x for the documented figure). All arms are injected by
// Istio's injector offline (Inject: istioctl kube-inject with istiod's own
// ConfigMaps; pilot.cni.enabled and the templates differ) and created in a namespace
// without istio-injection, so the admission webhook, the same for all in
// production, is not in the figure. A warm-up round (one pod per arm, started at
// once), not measured, proves the arms: what was injected, init exit 0, and TCP from
// each pod to the next captured by the sender's proxy on 15001 and the receiver's on
// 15006.
//
// Times are taken by the client, from just before the Create call to the first
// watch event showing the pod's istio-proxy running (sandbox with the CNI chain,
// the init container, the sidecar's start: where the arms differ, before the
// kubelet's probes, which run on a 1 s period) and to the one showing the pod
// Ready. Reported: p50 and p90 of both per arm in ms, the ratios meshcni /
// istio-init and validation-free / meshcni, the saving of validation-free against
// meshcni with istio-validation in ms, and the p50 of each init container's run (its
// log's first to last timestamp, as the container runtime recorded them).
func BenchmarkPodStart(b *testing.B) {
	testutil.RequireRoot(b)
	testutil.RequireBinary(b, "go")
	testutil.RequireBinary(b, "ctr")
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Minute)
	defer cancel()
	if _, err := istio.Lookup(ctx); err != nil {
		testutil.Missing(b, "%v", err)
	}
	tb := up(b) // the package's one Istio install
	inst := upInst
	if err := tb.CreateNamespace(ctx, benchNamespace); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		if err := istio.DeleteNamespace(context.Background(), tb, benchNamespace); err != nil {
			b.Error(err)
		}
	})
	arms := injectArms(ctx, b, tb, inst.Build)
	warmUp(ctx, b, tb, arms)
	for i := 0; b.Loop(); i++ {
		for j := range arms {
			a := arms[(i+j)%len(arms)]
			runPod(ctx, b, tb, a, fmt.Sprintf("%s-%d", a.name, i))
		}
	}
	report(b, inst.Build, arms)
}

// injectArms renders the benchmark pod in the three arms and checks what each
// rendered.
func injectArms(ctx context.Context, b *testing.B, tb *testbed.Testbed, build istio.Build) []*startArm {
	d := istio.Deployment(benchNamespace, "bench")
	base := &corev1.Pod{
		TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Pod"},
		ObjectMeta: metav1.ObjectMeta{Name: "bench", Namespace: benchNamespace, Labels: d.Spec.Template.Labels,
			// istiod's webhook makes istio-proxy a native sidecar on this Kubernetes;
			// offline, the injector needs to be told.
			Annotations: map[string]string{"sidecar.istio.io/nativeSidecar": "true"}},
		Spec: d.Spec.Template.Spec,
	}
	arms := []*startArm{{name: "meshcni", init: "istio-validation"}, {name: armValidationFree}, {name: "istio-init", init: "istio-init"}}
	for _, a := range arms {
		in := base
		if a.name == armValidationFree {
			in = base.DeepCopy()
			in.Annotations[istio.AnnotationTemplates] = validationFreeTemplates
		}
		p, err := istio.Inject(ctx, tb, build, in, a.name != "istio-init")
		if err != nil {
			b.Fatal(err)
		}
		a.pod = p
		var inits []string
		for _, c := range p.Spec.InitContainers {
			inits = append(inits, c.Name)
		}
		if a.init == "" {
			if !slices.Equal(inits, []string{istio.ProxyContainer}) {
				b.Fatalf("%s: the injector rendered init containers %q; want only %s", a.name, inits, istio.ProxyContainer)
			}
			b.Logf("%s: init containers %q", a.name, inits)
			continue
		}
		if !slices.Contains(inits, a.init) || !slices.Contains(inits, istio.ProxyContainer) || len(inits) != 2 {
			b.Fatalf("%s: the injector rendered init containers %q; want %s and %s", a.name, inits, a.init, istio.ProxyContainer)
		}
		c := benchContainer(p, a.init)
		netAdmin := c.SecurityContext != nil && c.SecurityContext.Capabilities != nil &&
			slices.Contains(c.SecurityContext.Capabilities.Add, "NET_ADMIN")
		if netAdmin != (a.name == "istio-init") {
			b.Fatalf("%s: %s adds NET_ADMIN: %v", a.name, a.init, netAdmin)
		}
		b.Logf("%s: %s %q", a.name, a.init, c.Args)
	}
	return arms
}

func benchContainer(p *corev1.Pod, name string) *corev1.Container {
	for i, c := range p.Spec.InitContainers {
		if c.Name == name {
			return &p.Spec.InitContainers[i]
		}
	}
	return nil
}

// warmUp starts one pod of each arm at once (not measured), checks that each init
// container exited 0 and that TCP from each pod to the next is captured by the
// sender's proxy on 15001 and the receiver's on 15006, then deletes them and waits
// until they are gone.
func warmUp(ctx context.Context, b *testing.B, tb *testbed.Testbed, arms []*startArm) {
	pods := make([]*corev1.Pod, len(arms))
	errs := make([]error, len(arms))
	var wg sync.WaitGroup
	for i, a := range arms {
		wg.Go(func() { pods[i], _, errs[i] = startPod(ctx, tb, a, a.name+"-warmup") })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		b.Fatal(err)
	}
	for i, a := range arms {
		if code := initExit(pods[i], a.init); a.init != "" && code != 0 {
			b.Fatalf("%s: %s exit code %d, want 0", pods[i].Name, a.init, code)
		}
	}
	for i := range pods {
		pair := [2]*corev1.Pod{pods[i], pods[(i+1)%len(pods)]}
		app := &istio.App{Namespace: benchNamespace, Client: pair[0], Server: pair[1]}
		tr, err := app.Probe(ctx, tb)
		if err != nil {
			b.Fatalf("%s → %s: %v", pair[0].Name, pair[1].Name, err)
		}
		if tr.Outbound.Local.Port() != 15001 || tr.Inbound.Local.Port() != 15006 || tr.Inbound.OrigDst != tr.Dst {
			b.Fatalf("%s → %s: outbound %+v, inbound %+v", pair[0].Name, pair[1].Name, tr.Outbound, tr.Inbound)
		}
		b.Logf("%s → %v captured on %v, arrived at %s's proxy on %v", pair[0].Name, tr.Dst, tr.Outbound.Local, pair[1].Name, tr.Inbound.Local)
	}
	for i, p := range pods {
		wg.Go(func() { errs[i] = tb.DeletePod(ctx, p.Namespace, p.Name) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		b.Fatal(err)
	}
}

// runPod starts one pod of the arm, records its times, and deletes it.
func runPod(ctx context.Context, b *testing.B, tb *testbed.Testbed, a *startArm, name string) {
	p, t, err := startPod(ctx, tb, a, name)
	if err != nil {
		b.Fatal(err)
	}
	a.ready, a.proxyUp = append(a.ready, t.ready), append(a.proxyUp, t.proxyUp)
	if a.init != "" {
		if run, err := initRun(ctx, tb, p, a.init); err == nil {
			a.initRun = append(a.initRun, run)
		} else {
			b.Logf("%s: %v", name, err)
		}
	}
	if err := tb.DeletePod(ctx, p.Namespace, p.Name); err != nil {
		b.Fatal(err)
	}
}

// startTimes are the times from the Create call to the first watch event showing
// the pod's istio-proxy running (after the init container, before its probes), and
// showing the pod Ready.
type startTimes struct{ proxyUp, ready time.Duration }

// startPod creates a pod of the arm named name and returns it once Ready, with its
// startTimes. A watch the server ends is resumed from the last event seen.
func startPod(ctx context.Context, tb *testbed.Testbed, a *startArm, name string) (*corev1.Pod, startTimes, error) {
	var t startTimes
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	pod := a.pod.DeepCopy()
	pod.Name = name
	pods := tb.Client.CoreV1().Pods(benchNamespace)
	opts := metav1.ListOptions{FieldSelector: "metadata.name=" + name}
	w, err := pods.Watch(ctx, opts)
	if err != nil {
		return nil, t, fmt.Errorf("watch pod %s: %w", name, err)
	}
	began := time.Now()
	if _, err := pods.Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		w.Stop()
		return nil, t, fmt.Errorf("create pod %s: %w", name, err)
	}
	var why error
	for ctx.Err() == nil {
		for ev := range w.ResultChan() {
			if ev.Type == watch.Error {
				why = apierrors.FromObject(ev.Object)
				continue
			}
			if p, ok := ev.Object.(*corev1.Pod); ok {
				opts.ResourceVersion = p.ResourceVersion
				if t.proxyUp == 0 && proxyRunning(p) {
					t.proxyUp = time.Since(began)
				}
				if podReady(p) {
					w.Stop()
					t.ready = time.Since(began)
					return p, t, nil
				}
			}
		}
		w.Stop()
		select {
		case <-ctx.Done():
		case <-time.After(100 * time.Millisecond):
		}
		if w, err = pods.Watch(ctx, opts); err != nil {
			why = err
			break
		}
	}
	// Not Ready in time: WaitPodReady describes why.
	dctx, dcancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
	defer dcancel()
	_, err = tb.WaitPodReady(dctx, benchNamespace, name)
	return nil, t, fmt.Errorf("pod %s not Ready %s after its creation (watch: %v): %w", name, time.Since(began).Round(time.Millisecond), why, err)
}

func proxyRunning(p *corev1.Pod) bool {
	for _, s := range append(p.Status.InitContainerStatuses, p.Status.ContainerStatuses...) {
		if s.Name == istio.ProxyContainer && s.State.Running != nil {
			return true
		}
	}
	return false
}

// initRun is the time between the first and the last line of an init container's
// log, by the timestamps the container runtime recorded.
func initRun(ctx context.Context, tb *testbed.Testbed, p *corev1.Pod, container string) (time.Duration, error) {
	raw, err := tb.Client.CoreV1().Pods(p.Namespace).GetLogs(p.Name, &corev1.PodLogOptions{Container: container, Timestamps: true}).DoRaw(ctx)
	if err != nil {
		return 0, fmt.Errorf("%s log: %w", container, err)
	}
	lines := strings.Split(strings.TrimSpace(string(raw)), "\n")
	first, err1 := logTime(lines[0])
	last, err2 := logTime(lines[len(lines)-1])
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("%s log timestamps: %v %v", container, err1, err2)
	}
	return last.Sub(first), nil
}

func logTime(line string) (time.Time, error) {
	ts, _, _ := strings.Cut(line, " ")
	return time.Parse(time.RFC3339Nano, ts)
}

// percentile is the nearest-rank p-th percentile (0 < p ≤ 1) of ds.
func percentile(ds []time.Duration, p float64) time.Duration {
	s := slices.Sorted(slices.Values(ds))
	i := int(math.Ceil(p*float64(len(s)))) - 1
	return s[max(i, 0)]
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// armValidationFree is the arm injected with the validation-free template.
const armValidationFree = "validation-free"

func armNamed(arms []*startArm, name string) *startArm {
	for _, a := range arms {
		if a.name == name {
			return a
		}
	}
	return nil
}

// report prints the table and reports the metrics.
func report(b *testing.B, build istio.Build, arms []*startArm) {
	var t strings.Builder
	fmt.Fprintf(&t, "Istio %s (%s), Kubernetes %s, %d pods per arm\n", build.Version, build.Release, testbed.KubernetesVersion, len(arms[0].ready))
	fmt.Fprintf(&t, "| arm | init container | create → istio-proxy running p50 | p90 | create → Ready p50 | p90 | init run p50 |\n")
	fmt.Fprintf(&t, "|---|---|---|---|---|---|---|\n")
	for _, a := range arms {
		run := "–"
		if len(a.initRun) > 0 {
			run = fmt.Sprintf("%.0f ms", ms(percentile(a.initRun, 0.5)))
			b.ReportMetric(ms(percentile(a.initRun, 0.5)), a.name+"-init-run-p50-ms")
		}
		init := a.init
		if init == "" {
			init = "none"
		}
		fmt.Fprintf(&t, "| %s | %s |", a.name, init)
		for _, m := range []struct {
			ds   []time.Duration
			unit string
		}{{a.proxyUp, "-proxy-up"}, {a.ready, ""}} {
			for _, q := range []float64{0.5, 0.9} {
				v := ms(percentile(m.ds, q))
				fmt.Fprintf(&t, " %.0f ms |", v)
				b.ReportMetric(v, fmt.Sprintf("%s%s-p%.0f-ms", a.name, m.unit, q*100))
			}
		}
		fmt.Fprintf(&t, " %s |\n", run)
	}
	mc, vf, ii := armNamed(arms, "meshcni"), armNamed(arms, armValidationFree), armNamed(arms, "istio-init")
	for _, m := range []struct {
		name string
		of   func(*startArm) []time.Duration
	}{{"proxy-up", func(a *startArm) []time.Duration { return a.proxyUp }}, {"ready", func(a *startArm) []time.Duration { return a.ready }}} {
		for _, q := range []float64{0.5, 0.9} {
			m0, v0, i0 := ms(percentile(m.of(mc), q)), ms(percentile(m.of(vf), q)), ms(percentile(m.of(ii), q))
			fmt.Fprintf(&t, "%s p%.0f: meshcni / istio-init %.2f, validation-free / meshcni %.2f, validation-free saves %.0f ms\n", m.name, q*100, m0/i0, v0/m0, m0-v0)
			b.ReportMetric(m0/i0, fmt.Sprintf("ratio-%s-p%.0f", m.name, q*100))
			b.ReportMetric(v0/m0, fmt.Sprintf("vf-ratio-%s-p%.0f", m.name, q*100))
			b.ReportMetric(m0-v0, fmt.Sprintf("vf-saving-%s-p%.0f-ms", m.name, q*100))
		}
	}
	b.Log("\n" + t.String())
}
