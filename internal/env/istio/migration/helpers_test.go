package migration

import (
	"context"
	"fmt"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/meshcni/meshcni/internal/env/demo"
	"github.com/meshcni/meshcni/internal/env/istio"
	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/standin/proxysim"
	"github.com/meshcni/meshcni/internal/tools/build/image"
	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/capture/k8spod"
	"github.com/meshcni/meshcni/pkg/engine"
)

// Audit is what the node sees of one meshed pod's network namespace.
type Audit struct {
	// Kinds are the rule backends holding redirect rules: nftables is meshcni's own
	// tables, iptables-nft / iptables-legacy Istio's ISTIO_* chains (istio-cni's, or
	// meshcni's when the pod's netns already held iptables tables).
	Kinds []backend.Kind
	// Drift is what engine.Check finds missing or extra against the rules Istio
	// writes for the pod ("" when none).
	Drift string
}

// audit reads the pod's network namespace from the node: which backends hold
// redirect rules, and whether they are the rules Istio's contract asks for the pod.
func audit(ctx context.Context, tb *testbed.Testbed, p *corev1.Pod) (Audit, error) {
	path, err := tb.PodNetns(ctx, p.Namespace, p.Name)
	if err != nil {
		return Audit{}, err
	}
	s, err := capture.Spec(k8spod.From(p))
	if err != nil {
		return Audit{}, fmt.Errorf("spec of %s: %w", p.Name, err)
	}
	var ips []netip.Addr
	for _, ip := range p.Status.PodIPs {
		if a, err := netip.ParseAddr(ip.IP); err == nil {
			ips = append(ips, a)
		}
	}
	capture.WithFamilies(s, ips)
	eo := engine.Options{Backend: backend.Auto, NetnsPath: path}
	live, err := engine.Live(ctx, eo)
	if err != nil {
		return Audit{}, fmt.Errorf("live rules of %s: %w", p.Name, err)
	}
	var a Audit
	for k, txt := range live {
		if strings.TrimSpace(txt) != "" {
			a.Kinds = append(a.Kinds, k)
		}
	}
	slices.Sort(a.Kinds)
	d, err := engine.Check(ctx, eo, s)
	if err != nil {
		return a, fmt.Errorf("check %s: %w", p.Name, err)
	}
	if !d.Empty() {
		a.Drift = d.String()
	}
	return a, nil
}

// Redirected says the pod's netns holds exactly the rules Istio writes for it.
func (a Audit) Redirected() bool { return len(a.Kinds) > 0 && a.Drift == "" }

// By names the plugin the rules are from: "meshcni" (its nftables tables),
// "istio-cni" (ISTIO_* iptables chains only), or both.
func (a Audit) By() string {
	var by []string
	if slices.Contains(a.Kinds, backend.Nftables) {
		by = append(by, "meshcni")
	}
	if slices.Contains(a.Kinds, backend.IptablesNft) || slices.Contains(a.Kinds, backend.IptablesLegacy) {
		by = append(by, "iptables ISTIO_*")
	}
	if len(by) == 0 {
		return "none"
	}
	return strings.Join(by, "+")
}

// loopPod is one pod the loop created and what became of it.
type loopPod struct {
	Name    string
	Created time.Duration // since the loop began
	Chain   []string      // the conflist's plugin types when it was created
	Started bool          // its app container ran
	// ValidationRuns is how many times istio-validation ran (1: redirected from the
	// start; more: the pod was repaired or retried).
	ValidationRuns int32
	Audit          Audit
	Err            string
}

// loop creates a meshed pod every interval in ns until stopped; each pod is followed
// until its app container runs (then audited from the node and deleted) or for
// startWait (then it did not start).
type loop struct {
	tb       *testbed.Testbed
	ns       string
	began    time.Time
	stop     chan struct{}
	wg       sync.WaitGroup
	mu       sync.Mutex
	pods     []*loopPod
	interval time.Duration
}

const startWait = 2 * time.Minute

func startLoop(ctx context.Context, t *testing.T, tb *testbed.Testbed, ns string, interval time.Duration) *loop {
	t.Helper()
	l := &loop{tb: tb, ns: ns, began: time.Now(), stop: make(chan struct{}), interval: interval}
	l.wg.Add(1)
	go l.run(ctx)
	return l
}

func (l *loop) run(ctx context.Context) {
	defer l.wg.Done()
	tpl := istio.Deployment(l.ns, "loop").Spec.Template
	for i := 0; ; i++ {
		chain, _ := istio.ChainTypes()
		lp := &loopPod{Name: fmt.Sprintf("loop-%03d", i), Created: time.Since(l.began), Chain: chain}
		pod := &corev1.Pod{ObjectMeta: *tpl.ObjectMeta.DeepCopy(), Spec: *tpl.Spec.DeepCopy()}
		pod.Name, pod.Namespace = lp.Name, l.ns
		l.mu.Lock()
		l.pods = append(l.pods, lp)
		l.mu.Unlock()
		if _, err := l.tb.Client.CoreV1().Pods(l.ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			lp.Err = "create: " + err.Error()
		} else {
			l.wg.Add(1)
			go l.follow(ctx, lp)
		}
		select {
		case <-l.stop:
			return
		case <-ctx.Done():
			return
		case <-time.After(l.interval):
		}
	}
}

// follow waits for the pod's app container to run, audits the pod and deletes it.
func (l *loop) follow(ctx context.Context, lp *loopPod) {
	defer l.wg.Done()
	wctx, cancel := context.WithTimeout(ctx, startWait)
	defer cancel()
	for {
		p, err := l.tb.Client.CoreV1().Pods(l.ns).Get(wctx, lp.Name, metav1.GetOptions{})
		if err == nil && appRunning(p) {
			lp.Started = true
			lp.ValidationRuns = validationRuns(p)
			a, err := audit(ctx, l.tb, p)
			lp.Audit = a
			if err != nil {
				lp.Err = err.Error()
			}
			break
		}
		select {
		case <-wctx.Done():
			if p != nil {
				lp.ValidationRuns = validationRuns(p)
			}
			lp.Err = "did not start within " + startWait.String()
			l.delete(ctx, lp.Name)
			return
		case <-time.After(300 * time.Millisecond):
		}
	}
	l.delete(ctx, lp.Name)
}

func (l *loop) delete(ctx context.Context, name string) {
	zero := int64(0)
	err := l.tb.Client.CoreV1().Pods(l.ns).Delete(context.WithoutCancel(ctx), name, metav1.DeleteOptions{GracePeriodSeconds: &zero})
	if err != nil && !apierrors.IsNotFound(err) {
		l.mu.Lock()
		defer l.mu.Unlock()
		for _, lp := range l.pods {
			if lp.Name == name && lp.Err == "" {
				lp.Err = "delete: " + err.Error()
			}
		}
	}
}

// finish stops creating pods and waits until every pod is audited or given up on.
func (l *loop) finish() []*loopPod {
	close(l.stop)
	l.wg.Wait()
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.pods
}

func appRunning(p *corev1.Pod) bool {
	for _, s := range p.Status.ContainerStatuses {
		if s.Name == istio.AppContainer && (s.State.Running != nil || s.State.Terminated != nil) {
			return true
		}
	}
	return false
}

// validationRuns counts istio-validation's runs (its restarts plus the current one).
func validationRuns(p *corev1.Pod) int32 {
	for _, s := range p.Status.InitContainerStatuses {
		if s.Name == "istio-validation" {
			if s.State.Terminated != nil || s.State.Running != nil {
				return s.RestartCount + 1
			}
			return s.RestartCount
		}
	}
	return 0
}

// judge fails the test for every pod that ran without Istio's rules, and logs the
// tally: pods created, started (by which rules), not started.
func judge(t *testing.T, what string, pods []*loopPod) {
	t.Helper()
	by := map[string]int{}
	started, notStarted := 0, 0
	for _, lp := range pods {
		switch {
		case lp.Started && lp.Audit.Redirected():
			started++
			by[lp.Audit.By()]++
		case lp.Started:
			t.Errorf("%s: %s ran unredirected or with other rules (created at %s, chain %q, validation runs %d): kinds %v, drift %s, err %s",
				what, lp.Name, lp.Created.Round(time.Millisecond), lp.Chain, lp.ValidationRuns, lp.Audit.Kinds, lp.Audit.Drift, lp.Err)
		default:
			notStarted++
			t.Logf("%s: %s did not start (created at %s, chain %q): %s", what, lp.Name, lp.Created.Round(time.Millisecond), lp.Chain, lp.Err)
		}
		if lp.Started && lp.ValidationRuns != 1 {
			t.Logf("%s: %s: istio-validation ran %d times", what, lp.Name, lp.ValidationRuns)
		}
	}
	t.Logf("%s: %d pods created, %d started and audited redirected (by %v), %d did not start", what, len(pods), started, by, notStarted)
	if started == 0 {
		t.Errorf("%s: no pod started during the switch: the loop proves nothing", what)
	}
}

// importMeshcni builds meshcni's image and imports it into the test bed (what
// demo.Install does before its helm install), for the doc's own helm command.
func importMeshcni(ctx context.Context, t *testing.T, root string) {
	t.Helper()
	out := image.DefaultArchive(root, image.DefaultTag)
	if _, err := image.Build(ctx, image.Options{RepoRoot: root, Out: out, WorkDir: filepath.Join(root, "bin", "images", "build")}); err != nil {
		t.Fatalf("build meshcni's image: %v", err)
	}
	if err := testbed.ImportImage(ctx, out); err != nil {
		t.Fatal(err)
	}
}

// setCNI brings the node to the start state: istio-cni installed or not, meshcni
// installed or not.
func setCNI(ctx context.Context, t *testing.T, tb *testbed.Testbed, istioCNI, meshcni bool) {
	t.Helper()
	o := istio.Options{RepoRoot: upRoot}
	helm, err := demo.HelmPath(ctx, upRoot)
	if err != nil {
		t.Fatal(err)
	}
	if meshcni {
		if _, err := demo.Install(ctx, tb, demo.Options{RepoRoot: upRoot, Keep: true}); err != nil {
			t.Fatalf("install meshcni: %v", err)
		}
	} else if err := demo.Down(ctx, tb, upRoot, helm, 3*time.Minute); err != nil {
		t.Fatalf("remove meshcni: %v", err)
	}
	if istioCNI {
		err = istio.InstallIstioCNI(ctx, tb, o)
	} else {
		err = istio.UninstallIstioCNI(ctx, tb, o)
	}
	if err != nil {
		t.Fatal(err)
	}
	chain, err := istio.ChainTypes()
	t.Logf("start: conflist plugins %q (%v)", chain, err)
}

// appTraffic probes client → server and returns the reply and the number of
// outbound captures of that destination the client's proxy has recorded so far.
func appTraffic(ctx context.Context, t *testing.T, tb *testbed.Testbed, app *istio.App, when string) int {
	t.Helper()
	tr, err := app.Probe(ctx, tb)
	if err != nil {
		t.Fatalf("%s: %v", when, err)
	}
	if !tr.Probe.Connected || !strings.Contains(tr.Probe.Reply, "127.0.0.6:") {
		t.Errorf("%s: probe %+v: want a reply through the server's inbound proxy (source 127.0.0.6)", when, tr.Probe)
	}
	logs, err := tb.PodLogs(ctx, app.Namespace, app.Client.Name, istio.ProxyContainer)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, r := range istio.ProxyRecords(logs) {
		if r.Event == proxysim.EventConn && r.Listener == proxysim.ListenerOutbound && r.OrigDst == tr.Dst {
			n++
		}
	}
	t.Logf("%s: %s → %v captured on %v (outbound) and %v (inbound); client proxy has %d outbound captures of it", when, app.Client.Name, tr.Dst, tr.Outbound.Local, tr.Inbound.Local, n)
	return n
}

// injected creates a namespace labelled istio-injection=enabled, deleted when the
// test ends.
func injected(ctx context.Context, t *testing.T, tb *testbed.Testbed, ns string) {
	t.Helper()
	t.Cleanup(func() {
		if err := istio.DeleteNamespace(context.Background(), tb, ns); err != nil {
			t.Error(err)
		}
	})
	if err := tb.CreateNamespace(ctx, ns); err != nil {
		t.Fatal(err)
	}
	label := []byte(`{"metadata":{"labels":{"istio-injection":"enabled"}}}`)
	if _, err := tb.Client.CoreV1().Namespaces().Patch(ctx, ns, types.StrategicMergePatchType, label, metav1.PatchOptions{}); err != nil {
		t.Fatalf("label namespace %s: %v", ns, err)
	}
}

// startApp starts istio.StartApp's client and server in ns (deleted at the end).
func startApp(ctx context.Context, t *testing.T, tb *testbed.Testbed, ns string) *istio.App {
	t.Helper()
	t.Cleanup(func() {
		if err := istio.DeleteNamespace(context.Background(), tb, ns); err != nil {
			t.Error(err)
		}
	})
	app, err := istio.StartApp(ctx, tb, ns)
	if err != nil {
		t.Fatalf("%v\n%s", err, diagnose(context.WithoutCancel(ctx), tb, ns))
	}
	t.Logf("pods %s and %s Ready %s after their Deployments were created", app.Server.Name, app.Client.Name, app.Ready.Round(time.Millisecond))
	return app
}

// diagnose lists the namespace's events and its pods' states, and install-cni's log.
func diagnose(ctx context.Context, tb *testbed.Testbed, ns string) string {
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	var b strings.Builder
	if evs, err := tb.Client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{}); err == nil {
		for _, e := range evs.Items {
			fmt.Fprintf(&b, "event %s/%s %s: %s\n", e.InvolvedObject.Kind, e.InvolvedObject.Name, e.Reason, e.Message)
		}
	}
	if pods, err := tb.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{}); err == nil {
		for _, p := range pods.Items {
			fmt.Fprintf(&b, "pod %s: %s %+v\n", p.Name, p.Status.Phase, p.Status.InitContainerStatuses)
		}
	}
	if pods, err := tb.Client.CoreV1().Pods(istio.Namespace).List(ctx, metav1.ListOptions{LabelSelector: "app=istiod"}); err == nil {
		for _, p := range pods.Items {
			fmt.Fprintf(&b, "istiod pod %s: %s hostNetwork=%v conditions %+v containers %+v\n", p.Name, p.Status.Phase, p.Spec.HostNetwork, p.Status.Conditions, p.Status.ContainerStatuses)
			logs, _ := tb.PodLogs(ctx, p.Namespace, p.Name, "discovery")
			lines := strings.Split(strings.TrimSpace(logs), "\n")
			fmt.Fprintf(&b, "istiod log tail:\n%s\n", strings.Join(lines[max(0, len(lines)-25):], "\n"))
		}
	}
	if pods, err := tb.Client.CoreV1().Pods(istio.Namespace).List(ctx, metav1.ListOptions{LabelSelector: "k8s-app=" + istio.CNIDaemonSet}); err == nil {
		for _, p := range pods.Items {
			logs, _ := tb.PodLogs(ctx, p.Namespace, p.Name, "install-cni")
			fmt.Fprintf(&b, "install-cni %s log:\n%s\n", p.Name, logs)
		}
	}
	return b.String()
}
