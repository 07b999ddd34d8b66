package repair_test

// The race, reproduced on the real test bed (internal/env/testbed, full mode): kubelet runs
// with the primary CNI only, meshed pods start unredirected and their real
// `meshcnictl validate` init container (UID 1337, non-root, no capabilities) exits
// 126; then the agent starts (in process: agent.New + AddRepair + Run, pointed at the
// test bed) and its repair controller must bring every one of them to Running with a
// redirect proven by real packets (in place), have them recreated with it (delete), or
// label them and do nothing else (label). Pods that are healthy, not meshed, failing
// otherwise or in an excluded namespace are never touched.

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/standin/proxysim"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/internal/testkit/traffic"
	"github.com/meshcni/meshcni/internal/tools/build/ociimage"
	"github.com/meshcni/meshcni/pkg/agent"
	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/capture/k8spod"
	"github.com/meshcni/meshcni/pkg/cniconf"
	"github.com/meshcni/meshcni/pkg/engine"
	"github.com/meshcni/meshcni/pkg/fileutil"
	"github.com/meshcni/meshcni/pkg/podget"
	"github.com/meshcni/meshcni/pkg/podnetns"
	"github.com/meshcni/meshcni/pkg/repair"
)

func TestMain(m *testing.M) {
	code := testbed.RunMain(m)
	if binDir != "" {
		os.RemoveAll(binDir)
	}
	os.Exit(code)
}

const (
	toolsImage = "meshcni.local/repair-e2e/tools:dev"
	// testbedNetnsDir is where the test bed's containerd keeps pod network namespaces.
	testbedNetnsDir = testbed.RunDir + "/containerd/io.containerd.grpc.v1.cri/netns"
	// Namespaces the agent excludes (one per test: a deleted namespace lingers).
	excludedNS    = "repair-e2e-excluded"
	excludedDelNS = "repair-e2e-excluded-del"
	// runningBound covers kubelet's back-off before it reruns a failed init
	// container (10 s, then 20 s, ...).
	runningBound = 75 * time.Second
)

var (
	buildOnce sync.Once
	binDir    string
	buildErr  error
)

// setup builds meshcni (for the agent to install), meshcnictl and meshcni-proxysim,
// and imports a FROM-scratch image with the latter two into the test bed, once.
func setup(t testing.TB, tb *testbed.Testbed) string {
	t.Helper()
	testutil.RequireBinary(t, "go")
	buildOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		root, err := testutil.RepoRoot()
		if err != nil {
			buildErr = err
			return
		}
		if binDir, buildErr = os.MkdirTemp("", "meshcni-repair-e2e-"); buildErr != nil {
			return
		}
		for name, pkg := range map[string]string{"meshcni": "./cmd/meshcni", podget.HelperName: "./cmd/meshcni-podget", "meshcnictl": "./cmd/meshcnictl", "meshcni-proxysim": "./hack/proxysim"} {
			if buildErr = ociimage.GoBinary(ctx, root, pkg, filepath.Join(binDir, name)); buildErr != nil {
				return
			}
		}
		archive := filepath.Join(binDir, "tools.tar")
		if buildErr = ociimage.BuildArchive(ctx, archive, ociimage.Options{Ref: toolsImage, Files: map[string]string{
			"/meshcnictl":       filepath.Join(binDir, "meshcnictl"),
			"/meshcni-proxysim": filepath.Join(binDir, "meshcni-proxysim"),
		}}); buildErr != nil {
			return
		}
		buildErr = testbed.ImportImage(ctx, archive)
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	// Every scenario starts from the primary CNI only: meshcni is not in the chain.
	if err := testbed.WriteConflist(testbed.DefaultConflist()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = testbed.WriteConflist(testbed.DefaultConflist()) })
	return binDir
}

// Pod kinds of the population.
type podKind int

const (
	meshedBroken    podKind = iota // meshed, validation runs (and fails without rules)
	meshedHealthy                  // meshed, validation container completes (exit 0)
	plainBroken                    // no sidecar, validation fails 126
	meshedOtherExit                // meshed, validation fails with exit code 1
)

func nonRoot(uid int64) *corev1.SecurityContext {
	no, yes := false, true
	return &corev1.SecurityContext{
		RunAsUser: &uid, RunAsGroup: &uid, RunAsNonRoot: &yes,
		AllowPrivilegeEscalation: &no, ReadOnlyRootFilesystem: &yes,
		Capabilities: &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
	}
}

// podSpec is a pod with Istio's validation init container (the real meshcnictl
// validate as UID 1337, non-root, no capabilities, like istio-validation), the echo
// app and, when meshed, an istio-proxy stand-in (meshcni-proxysim as UID 1337)
// injected by "Istio" (sidecar.istio.io/status).
func podSpec(kind podKind) (corev1.PodSpec, map[string]string) {
	zero := int64(0)
	validate := []string{"/meshcnictl", "validate", "--probe-timeout=1s"}
	switch kind {
	case meshedHealthy:
		validate = []string{"/meshcnictl", "--help"}
	case meshedOtherExit:
		validate = []string{"/meshcnictl", "validate", "--probe-timeout=bad"}
	}
	s := corev1.PodSpec{
		TerminationGracePeriodSeconds: &zero,
		InitContainers: []corev1.Container{{
			Name: repair.DefaultInitContainer, Image: toolsImage, ImagePullPolicy: corev1.PullNever,
			Command: validate, SecurityContext: nonRoot(1337),
		}},
		Containers: []corev1.Container{{
			Name: "app", Image: testbed.EchoImage, ImagePullPolicy: corev1.PullNever,
			Ports: []corev1.ContainerPort{{ContainerPort: testbed.EchoPort}},
		}},
	}
	if kind == plainBroken {
		return s, nil
	}
	s.Containers = append(s.Containers, corev1.Container{
		Name: capture.ProxyContainer, Image: toolsImage, ImagePullPolicy: corev1.PullNever,
		Command:         []string{"/meshcni-proxysim", "serve", "--ipv6=false"},
		SecurityContext: nonRoot(1337),
	})
	return s, map[string]string{capture.AnnotationStatus: `{"initContainers":["istio-validation"],"containers":["istio-proxy"]}`}
}

func newPod(ns, name string, kind podKind) *corev1.Pod {
	s, ann := podSpec(kind)
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Annotations: ann, Labels: map[string]string{"app": name}}, Spec: s}
}

func namespace(t testing.TB, ctx context.Context, tb *testbed.Testbed, name string) {
	t.Helper()
	if err := tb.CreateNamespace(ctx, name); err != nil && !apierrors.IsAlreadyExists(err) && !strings.Contains(err.Error(), "already exists") {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = tb.Client.CoreV1().Namespaces().Delete(context.Background(), name, metav1.DeleteOptions{})
	})
}

// waitFor polls cond every 50 ms until it holds, fails or d passes.
func waitFor(t testing.TB, ctx context.Context, d time.Duration, what string, cond func() (bool, error)) {
	t.Helper()
	deadline := time.Now().Add(d)
	var last error
	for {
		ok, err := cond()
		if ok {
			return
		}
		last = err
		if time.Now().After(deadline) || ctx.Err() != nil {
			t.Fatalf("%s: not within %s (last: %v)", what, d, last)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// initExit is the last exit code of the validation init container (-1: none yet) and
// whether it completed.
func initExit(p *corev1.Pod) (code int32, completed bool) {
	for _, s := range p.Status.InitContainerStatuses {
		if s.Name != repair.DefaultInitContainer {
			continue
		}
		if t := s.State.Terminated; t != nil {
			return t.ExitCode, t.ExitCode == 0
		}
		if t := s.LastTerminationState.Terminated; t != nil {
			return t.ExitCode, false
		}
	}
	return -1, false
}

// waitInitExit waits until the pod's validation container has exited with code.
func waitInitExit(t testing.TB, ctx context.Context, tb *testbed.Testbed, ns, name string, code int32) *corev1.Pod {
	t.Helper()
	var pod *corev1.Pod
	waitFor(t, ctx, 60*time.Second, fmt.Sprintf("%s/%s: %s exits %d", ns, name, repair.DefaultInitContainer, code), func() (bool, error) {
		p, err := tb.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		pod = p
		c, _ := initExit(p)
		return c == code, fmt.Errorf("exit %d, phase %s", c, p.Status.Phase)
	})
	return pod
}

// logRecord is one agent log record.
type logRecord struct {
	time  time.Time
	level slog.Level
	msg   string
	attrs map[string]string
}

// logSink is a slog.Handler that keeps the agent's records for the test.
type logSink struct {
	mu      *sync.Mutex
	records *[]logRecord
	attrs   []slog.Attr
}

func newLogSink() *logSink { return &logSink{mu: &sync.Mutex{}, records: &[]logRecord{}} }

func (h *logSink) Enabled(context.Context, slog.Level) bool { return true }
func (h *logSink) WithGroup(string) slog.Handler            { return h }
func (h *logSink) WithAttrs(as []slog.Attr) slog.Handler {
	return &logSink{mu: h.mu, records: h.records, attrs: append(slices.Clone(h.attrs), as...)}
}
func (h *logSink) Handle(_ context.Context, r slog.Record) error {
	rec := logRecord{time: r.Time, level: r.Level, msg: r.Message, attrs: map[string]string{}}
	for _, a := range h.attrs {
		rec.attrs[a.Key] = a.Value.String()
	}
	r.Attrs(func(a slog.Attr) bool { rec.attrs[a.Key] = a.Value.String(); return true })
	h.mu.Lock()
	*h.records = append(*h.records, rec)
	h.mu.Unlock()
	return nil
}

func (h *logSink) find(msg string) []logRecord {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []logRecord
	for _, r := range *h.records {
		if r.msg == msg {
			out = append(out, r)
		}
	}
	return out
}

func (h *logSink) dump(t testing.TB) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, r := range *h.records {
		if r.level >= slog.LevelInfo {
			t.Logf("agent %s %s %v", r.level, r.msg, r.attrs)
		}
	}
}

// runningAgent is an in-process meshcni-agent on the test bed.
type runningAgent struct {
	*agent.Agent
	logs    *logSink
	started time.Time
	stop    func() // stops it (once); also run when the test ends
}

// startAgent runs the agent against the test bed with the repair controller in
// action; it is stopped (and the plugin uninstalled) when the test ends.
func startAgent(t testing.TB, tb *testbed.Testbed, bin string, action repair.Action) *runningAgent {
	t.Helper()
	runDir, err := os.MkdirTemp("/run", "meshcni-repair-e2e-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(runDir) })
	cfg, err := agent.ParseFlags([]string{
		"--cni-bin-dir", testbed.CNIBinDir, "--cni-conf-dir", testbed.CNIConfDir,
		"--plugin-binary", filepath.Join(bin, "meshcni"), "--run-dir", runDir,
		"--kubeconfig", tb.Kubeconfig(), "--kubeconfig-source", tb.Kubeconfig(),
		"--node-name", testbed.NodeName, "--health-addr", "127.0.0.1:0",
		"--exclude-namespaces", "kube-system," + excludedNS + "," + excludedDelNS,
		"--repair-action", string(action), "--repair-netns-dirs", testbedNetnsDir,
		// The eviction test evicts a whole ReplicaSet: a budget that allows it (the
		// budget and its breaker are proven in pkg/heal).
		"--heal-max-evictions", "100", "--heal-max-evict-fraction", "1",
	}, func(string) string { return "" }, os.Stderr)
	if err != nil {
		t.Fatal(err)
	}
	kube, err := agent.NewKube(cfg)
	if err != nil {
		t.Fatal(err)
	}
	logs := newLogSink()
	a, err := agent.New(cfg, slog.New(logs), agent.Options{Kube: kube})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.AddRepair(kube); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	ra := &runningAgent{Agent: a, logs: logs, started: time.Now()}
	go func() { done <- a.Run(ctx) }()
	ra.stop = sync.OnceFunc(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("agent: %v", err)
		}
		kube.Stop()
		if t.Failed() {
			logs.dump(t)
		}
	})
	t.Cleanup(ra.stop)
	return ra
}

// watching is when the repair controller's cache had synced.
func (a *runningAgent) watching(t testing.TB, ctx context.Context) time.Time {
	t.Helper()
	var at time.Time
	waitFor(t, ctx, 30*time.Second, "repair controller watching", func() (bool, error) {
		r := a.logs.find(repair.LogWatching)
		if len(r) == 0 {
			return false, nil
		}
		at = r[0].time
		return true, nil
	})
	return at
}

// lookedAt waits until the agent's repair controller has judged the pod: it found it
// not broken, decided there was nothing to do, or acted (any outcome). Only then does
// "nothing was done to it" prove anything.
func (a *runningAgent) lookedAt(t testing.TB, ctx context.Context, p *corev1.Pod) {
	t.Helper()
	waitFor(t, ctx, 30*time.Second, fmt.Sprintf("repair controller judged %s/%s", p.Namespace, p.Name), func() (bool, error) {
		for _, msg := range []string{repair.LogNotBroken, repair.LogNothingToDo, repair.LogSucceeded, repair.LogFailed, repair.LogGaveUp} {
			for _, r := range a.logs.find(msg) {
				if r.attrs["pod_uid"] == string(p.UID) {
					return true, nil
				}
			}
		}
		return false, nil
	})
}

// repairs returns the successful actions per pod name.
func (a *runningAgent) repairs() map[string]logRecord {
	out := map[string]logRecord{}
	for _, r := range a.logs.find(repair.LogSucceeded) {
		out[r.attrs["pod_namespace"]+"/"+r.attrs["pod_name"]] = r
	}
	return out
}

// repairCount reads meshcni_repairs_total{action,result} from the agent's registry.
func (a *runningAgent) repairCount(t testing.TB, action, result string) float64 {
	t.Helper()
	fams, err := a.Metrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() != "meshcni_repairs_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			l := map[string]string{}
			for _, lp := range m.GetLabel() {
				l[lp.GetName()] = lp.GetValue()
			}
			if l["action"] == action && l["result"] == result {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}

// agentEvents lists the agent's Events on the object with uid.
func agentEvents(t *testing.T, ctx context.Context, tb *testbed.Testbed, ns string, uid types.UID) []corev1.Event {
	t.Helper()
	evs, err := tb.Client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.uid=" + string(uid)})
	if err != nil {
		t.Fatal(err)
	}
	var out []corev1.Event
	for _, e := range evs.Items {
		if e.Source.Component == "meshcni-agent" {
			out = append(out, e)
		}
	}
	return out
}

func waitEvent(t *testing.T, ctx context.Context, tb *testbed.Testbed, pod *corev1.Pod, typ, reason string) {
	t.Helper()
	waitFor(t, ctx, 15*time.Second, fmt.Sprintf("%s Event %s on %s", typ, reason, pod.Name), func() (bool, error) {
		for _, e := range agentEvents(t, ctx, tb, pod.Namespace, pod.UID) {
			if e.Type == typ && e.Reason == reason {
				return true, nil
			}
		}
		return false, nil
	})
}

// podNetns finds a pod's netns as the agent does (by its IPs) and holds it until the
// test ends: the path returned is the handle's (/proc/self/fd/N).
func podNetns(t testing.TB, ctx context.Context, pod *corev1.Pod) string {
	t.Helper()
	h, err := (&podnetns.Finder{NetnsDirs: []string{testbedNetnsDir}, ProcDir: "-"}).FindPod(ctx, pod)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Close() })
	return h.NetnsPath()
}

// rulesIn reports the live meshcni rules in the pod's netns ("" = none).
func rulesIn(t testing.TB, ctx context.Context, pod *corev1.Pod) string {
	t.Helper()
	live, err := engine.Live(ctx, engine.Options{Backend: backend.Auto, NetnsPath: podNetns(t, ctx, pod)})
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	for k, v := range live {
		if strings.TrimSpace(v) != "" {
			fmt.Fprintf(&b, "%s:\n%s\n", k, v)
		}
	}
	return b.String()
}

// assertRedirected checks the pod's rules against its spec and sends a real
// connection from the app's UID to an outside address: the proxy stand-in in the pod
// must accept it on its outbound listener with SO_ORIGINAL_DST = that address.
func assertRedirected(t *testing.T, ctx context.Context, pod *corev1.Pod) {
	t.Helper()
	ips, err := podnetns.PodIPs(pod)
	if err != nil {
		t.Fatal(err)
	}
	res, err := capture.ForPod(k8spod.From(pod), ips)
	if err != nil {
		t.Fatal(err)
	}
	netns := podNetns(t, ctx, pod)
	if d, err := engine.Check(ctx, engine.Options{Backend: backend.Auto, NetnsPath: netns}, res.Spec); err != nil || !d.Empty() {
		t.Fatalf("%s: rules: err %v, drift:\n%s", pod.Name, err, d)
	}
	dst := netip.AddrPortFrom(netip.MustParseAddr(testbed.NodeIP), 9)
	var a traffic.Answer
	waitFor(t, ctx, 10*time.Second, pod.Name+": outbound connection captured by the proxy", func() (bool, error) {
		a = traffic.Dial(t, netns, dst, traffic.DialOptions{Cred: traffic.Cred{UID: 1000, GID: 1000}, Timeout: time.Second})
		return a.Listener() == proxysim.ListenerOutbound && a.OrigDst() == dst, fmt.Errorf("%+v", a.ProbeResult)
	})
}

// waitRunning waits until the pod runs with its validation init container completed.
func waitRunning(t *testing.T, ctx context.Context, tb *testbed.Testbed, ns, name string, d time.Duration) *corev1.Pod {
	t.Helper()
	var pod *corev1.Pod
	waitFor(t, ctx, d, ns+"/"+name+" Running with "+repair.DefaultInitContainer+" completed", func() (bool, error) {
		p, err := tb.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		pod = p
		code, done := initExit(p)
		return done && p.Status.Phase == corev1.PodRunning && allStarted(p), fmt.Errorf("phase %s, init exit %d", p.Status.Phase, code)
	})
	return pod
}

func allStarted(p *corev1.Pod) bool {
	if len(p.Status.ContainerStatuses) != len(p.Spec.Containers) {
		return false
	}
	for _, c := range p.Status.ContainerStatuses {
		if c.State.Running == nil {
			return false
		}
	}
	return true
}

// untouched asserts the agent left a pod alone once its repair controller has judged
// it: same UID, no Event from the agent, no repair label, no meshcni rules in its netns.
func untouched(t *testing.T, ctx context.Context, tb *testbed.Testbed, a *runningAgent, before *corev1.Pod) {
	t.Helper()
	a.lookedAt(t, ctx, before)
	p, err := tb.Client.CoreV1().Pods(before.Namespace).Get(ctx, before.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("%s/%s: %v (deleted?)", before.Namespace, before.Name, err)
	}
	if p.UID != before.UID {
		t.Fatalf("%s/%s was recreated (UID %s, was %s)", p.Namespace, p.Name, p.UID, before.UID)
	}
	if v, ok := p.Labels[repair.DefaultLabelKey]; ok {
		t.Fatalf("%s/%s labelled %s=%s", p.Namespace, p.Name, repair.DefaultLabelKey, v)
	}
	if evs := agentEvents(t, ctx, tb, p.Namespace, p.UID); len(evs) > 0 {
		t.Fatalf("%s/%s has agent Events: %+v", p.Namespace, p.Name, evs)
	}
	if r := rulesIn(t, ctx, p); r != "" {
		t.Fatalf("%s/%s has meshcni rules:\n%s", p.Namespace, p.Name, r)
	}
}

// TestRaceRepairInPlace: N meshed pods fail validation (126) without meshcni; the
// agent starts and repairs them in place; a mixed population next to them is never
// touched. How fast it repairs them is BenchmarkRaceRepairInPlace's figure.
func TestRaceRepairInPlace(t *testing.T) {
	tb := testbed.Shared(t)
	bin := setup(t, tb)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	const ns = "repair-e2e-inplace"
	namespace(t, ctx, tb, ns)
	namespace(t, ctx, tb, excludedNS)

	const n = 4
	broken := createBroken(t, ctx, tb, ns, n)
	others := createOthers(t, ctx, tb, ns, excludedNS, "")

	// The race: without meshcni in the chain, validation finds no redirect.
	t0 := time.Now()
	waitBroken(t, ctx, tb, ns, broken)
	before := others.wait(t, ctx, tb)
	t.Logf("%d meshed pods failed validation with 126 within %s", n, time.Since(t0).Round(time.Millisecond))

	a := startAgent(t, tb, bin, repair.ActionRepair)
	ready, last := a.waitRepaired(t, ctx, ns, broken)
	t.Logf("in place: agent ready (cache synced) %s after Run; last of %d pods repaired (rules applied) %s after ready",
		ready.Sub(a.started).Round(time.Millisecond), n, last.Sub(ready).Round(time.Millisecond))

	for _, name := range broken {
		pod := waitRunning(t, ctx, tb, ns, name, runningBound)
		assertRedirected(t, ctx, pod)
		waitEvent(t, ctx, tb, pod, corev1.EventTypeNormal, repair.ReasonRepaired)
	}
	t.Logf("all %d pods Running and redirected %s after the agent was ready", n, time.Since(ready).Round(time.Millisecond))
	if got := a.repairCount(t, "repair", "success"); got != n {
		t.Errorf("meshcni_repairs_total{action=repair,result=success} = %v, want %d", got, n)
	}
	if got := a.repairCount(t, "repair", "error"); got != 0 {
		t.Errorf("meshcni_repairs_total{action=repair,result=error} = %v, want 0", got)
	}
	// Each pod once: no second action for the same failed run.
	if got := len(a.logs.find(repair.LogSucceeded)); got != n {
		t.Errorf("%d successful actions logged, want %d", got, n)
	}
	for _, p := range before {
		untouched(t, ctx, tb, a, p)
	}
}

// createBroken creates n meshed pods whose validation fails without meshcni.
func createBroken(t testing.TB, ctx context.Context, tb *testbed.Testbed, ns string, n int) []string {
	t.Helper()
	var names []string
	for i := range n {
		name := fmt.Sprintf("broken-%d", i)
		if _, err := tb.CreatePod(ctx, newPod(ns, name, meshedBroken)); err != nil {
			t.Fatal(err)
		}
		names = append(names, name)
	}
	return names
}

// waitBroken waits until each pod's validation has exited 126, and checks that no
// meshcni rule is in its netns yet.
func waitBroken(t testing.TB, ctx context.Context, tb *testbed.Testbed, ns string, names []string) {
	t.Helper()
	for _, name := range names {
		p := waitInitExit(t, ctx, tb, ns, name, 126)
		if r := rulesIn(t, ctx, p); r != "" {
			t.Fatalf("%s has rules before the agent runs:\n%s", name, r)
		}
	}
}

// waitRepaired waits until the agent has repaired every named pod in place and
// returns when its repair controller was ready (cache synced) and when it logged
// the last repair.
func (a *runningAgent) waitRepaired(t testing.TB, ctx context.Context, ns string, names []string) (ready, last time.Time) {
	t.Helper()
	ready = a.watching(t, ctx)
	waitFor(t, ctx, time.Minute, "every broken pod repaired", func() (bool, error) {
		got := a.repairs()
		for _, name := range names {
			r, ok := got[ns+"/"+name]
			if !ok {
				return false, fmt.Errorf("%s not yet", name)
			}
			if r.time.After(last) {
				last = r.time
			}
		}
		return true, nil
	})
	return ready, last
}

// BenchmarkRaceRepairInPlace measures the in-place repair of the race: per iteration,
// n meshed pods fail validation (126) without meshcni in a namespace of their own,
// then an agent starts. Reported (medians): ready-ms, from the agent's Run to its
// repair controller's cache synced; repaired-ms, from then to the last of the n pods
// repaired (rules applied, logged by the controller). ns/op includes the pods' start.
func BenchmarkRaceRepairInPlace(b *testing.B) {
	tb := testbed.Shared(b)
	bin := setup(b, tb)
	const n = 4
	var readies, repaired []time.Duration
	for i := 0; b.Loop(); i++ {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		ns := fmt.Sprintf("repair-bench-%d-%d", os.Getpid(), i)
		namespace(b, ctx, tb, ns)
		broken := createBroken(b, ctx, tb, ns, n)
		waitBroken(b, ctx, tb, ns, broken)
		a := startAgent(b, tb, bin, repair.ActionRepair)
		ready, last := a.waitRepaired(b, ctx, ns, broken)
		a.stop()
		readies, repaired = append(readies, ready.Sub(a.started)), append(repaired, last.Sub(ready))
		// The next iteration's agent must find only its own broken pods.
		if err := tb.Client.CoreV1().Namespaces().Delete(ctx, ns, metav1.DeleteOptions{}); err != nil {
			b.Fatal(err)
		}
		cancel()
	}
	b.ReportMetric(medianMs(readies), "ready-ms")
	b.ReportMetric(medianMs(repaired), "repaired-ms")
}

func medianMs(ds []time.Duration) float64 {
	slices.Sort(ds)
	return float64(ds[len(ds)/2].Microseconds()) / 1000
}

// population is the pods the agent must never touch: a healthy meshed pod, a plain
// pod whose validation fails 126, a meshed pod failing with exit code 1 and a
// failing meshed pod in an excluded namespace.
type population struct {
	ns, excluded, prefix string
}

func createOthers(t *testing.T, ctx context.Context, tb *testbed.Testbed, ns, excluded, prefix string) population {
	t.Helper()
	for _, p := range []*corev1.Pod{
		newPod(ns, prefix+"healthy", meshedHealthy),
		newPod(ns, prefix+"plain", plainBroken),
		newPod(ns, prefix+"other-exit", meshedOtherExit),
		newPod(excluded, prefix+"excluded", meshedBroken),
	} {
		if _, err := tb.CreatePod(ctx, p); err != nil {
			t.Fatal(err)
		}
	}
	return population{ns: ns, excluded: excluded, prefix: prefix}
}

// wait returns the population once each pod is in its state (failed or running).
func (o population) wait(t *testing.T, ctx context.Context, tb *testbed.Testbed) []*corev1.Pod {
	t.Helper()
	return []*corev1.Pod{
		waitInitExit(t, ctx, tb, o.ns, o.prefix+"plain", 126),
		waitInitExit(t, ctx, tb, o.ns, o.prefix+"other-exit", 1),
		waitInitExit(t, ctx, tb, o.excluded, o.prefix+"excluded", 126),
		waitRunning(t, ctx, tb, o.ns, o.prefix+"healthy", 30*time.Second),
	}
}

// TestRaceDelete: pods of a ReplicaSet fail validation; the agent (delete action)
// installs the plugin and deletes them; their replacements get the redirect at ADD.
func TestRaceDelete(t *testing.T) {
	tb := testbed.Shared(t)
	bin := setup(t, tb)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	const ns = "repair-e2e-delete"
	namespace(t, ctx, tb, ns)
	const n = 2
	s, ann := podSpec(meshedBroken)
	replicas := int32(n)
	sel := map[string]string{"app": "rs"}
	rs, err := tb.Client.AppsV1().ReplicaSets(ns).Create(ctx, &appsv1.ReplicaSet{
		ObjectMeta: metav1.ObjectMeta{Name: "rs", Namespace: ns},
		Spec: appsv1.ReplicaSetSpec{
			Replicas: &replicas,
			Selector: &metav1.LabelSelector{MatchLabels: sel},
			Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: sel, Annotations: ann}, Spec: s},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	list := func() []corev1.Pod {
		l, err := tb.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: "app=rs"})
		if err != nil {
			t.Fatal(err)
		}
		return l.Items
	}
	namespace(t, ctx, tb, excludedDelNS)
	others := createOthers(t, ctx, tb, ns, excludedDelNS, "del-")
	waitFor(t, ctx, 30*time.Second, "ReplicaSet pods created", func() (bool, error) { return len(list()) == n, nil })
	var orig []*corev1.Pod
	for _, p := range list() {
		orig = append(orig, waitInitExit(t, ctx, tb, ns, p.Name, 126))
	}
	before := others.wait(t, ctx, tb)

	a := startAgent(t, tb, bin, repair.ActionEvict)
	ready := a.watching(t, ctx)
	for _, p := range orig {
		waitFor(t, ctx, 30*time.Second, p.Name+" deleted", func() (bool, error) {
			_, err := tb.Client.CoreV1().Pods(ns).Get(ctx, p.Name, metav1.GetOptions{})
			return apierrors.IsNotFound(err), err
		})
		waitEvent(t, ctx, tb, p, corev1.EventTypeNormal, repair.ReasonDeleted)
	}
	t.Logf("delete: %d pods deleted within %s of the agent being ready", n, time.Since(ready).Round(time.Millisecond))
	isOrig := func(uid types.UID) bool {
		return slices.ContainsFunc(orig, func(p *corev1.Pod) bool { return p.UID == uid })
	}
	var fresh []string
	waitFor(t, ctx, 30*time.Second, "replacement pods", func() (bool, error) {
		fresh = fresh[:0]
		for _, p := range list() {
			if !isOrig(p.UID) && p.DeletionTimestamp == nil {
				fresh = append(fresh, p.Name)
			}
		}
		return len(fresh) == n, nil
	})
	for _, name := range fresh {
		// Redirected at ADD by the plugin the agent installed: validation passes at once.
		pod := waitRunning(t, ctx, tb, ns, name, 30*time.Second)
		if code, _ := initExit(pod); code != 0 {
			t.Fatalf("%s: validation exit %d", name, code)
		}
		assertRedirected(t, ctx, pod)
		if evs := agentEvents(t, ctx, tb, ns, pod.UID); len(evs) > 0 {
			t.Fatalf("replacement %s got agent Events: %+v", name, evs)
		}
	}
	t.Logf("delete: %d replacement pods Running and redirected %s after the agent was ready", n, time.Since(ready).Round(time.Millisecond))
	if got := a.repairCount(t, "evict", "success"); got != n {
		t.Errorf("meshcni_repairs_total{action=evict,result=success} = %v, want %d", got, n)
	}
	for _, p := range before {
		untouched(t, ctx, tb, a, p)
	}
	_ = tb.Client.AppsV1().ReplicaSets(ns).Delete(context.Background(), rs.Name, metav1.DeleteOptions{})
}

// TestRaceLabel: the label action labels the broken pods and does nothing else.
func TestRaceLabel(t *testing.T) {
	tb := testbed.Shared(t)
	bin := setup(t, tb)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	const ns = "repair-e2e-label"
	namespace(t, ctx, tb, ns)
	const n = 2
	var orig []*corev1.Pod
	for i := range n {
		if _, err := tb.CreatePod(ctx, newPod(ns, fmt.Sprintf("broken-%d", i), meshedBroken)); err != nil {
			t.Fatal(err)
		}
	}
	for i := range n {
		orig = append(orig, waitInitExit(t, ctx, tb, ns, fmt.Sprintf("broken-%d", i), 126))
	}
	a := startAgent(t, tb, bin, repair.ActionLabel)
	ready := a.watching(t, ctx)
	for _, p := range orig {
		waitFor(t, ctx, 10*time.Second, p.Name+" labelled", func() (bool, error) {
			q, err := tb.Client.CoreV1().Pods(ns).Get(ctx, p.Name, metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			return q.Labels[repair.DefaultLabelKey] == repair.LabelValue, nil
		})
		waitEvent(t, ctx, tb, p, corev1.EventTypeNormal, repair.ReasonLabeled)
	}
	t.Logf("label: %d pods labelled within %s of the agent being ready", n, time.Since(ready).Round(time.Millisecond))
	for _, p := range orig {
		q, err := tb.Client.CoreV1().Pods(ns).Get(ctx, p.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if q.UID != p.UID {
			t.Fatalf("%s recreated", p.Name)
		}
		if r := rulesIn(t, ctx, q); r != "" {
			t.Fatalf("label action wrote rules into %s:\n%s", p.Name, r)
		}
		if code, done := initExit(q); done || code != 126 {
			t.Fatalf("%s: validation exit %d completed %v, want still failing 126", p.Name, code, done)
		}
		evs := agentEvents(t, ctx, tb, ns, q.UID)
		if len(evs) != 1 || evs[0].Reason != repair.ReasonLabeled {
			t.Fatalf("%s: agent Events %+v, want one %s", p.Name, evs, repair.ReasonLabeled)
		}
	}
	if got := a.repairCount(t, "label", "success"); got != n {
		t.Errorf("meshcni_repairs_total{action=label,result=success} = %v, want %d", got, n)
	}
}

// TestRewriteLoop: while the primary CNI rewrites its conflist without meshcni's entry
// every 300 ms (temp + rename, as a primary CNI does) and the agent re-injects it,
// meshed pods are created one every 200 ms; a pod whose sandbox was set up in a
// window without the entry fails validation (126) and is repaired in place. The
// claim: every pod whose app container started is redirected, and its app started
// once, after the redirect — by ADD or by the repair controller.
func TestRewriteLoop(t *testing.T) {
	tb := testbed.Shared(t)
	bin := setup(t, tb)
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	const ns = "repair-e2e-rewrite"
	namespace(t, ctx, tb, ns)

	a := startAgent(t, tb, bin, repair.ActionRepair)
	a.watching(t, ctx)
	waitEntry(t, ctx)
	failed := exits126(t, ctx, tb, ns)

	const n = 15
	stopLoop, rewrites := rewriteLoop(t, 300*time.Millisecond)
	var names []string
	for i := range n {
		name := fmt.Sprintf("pod-%02d", i)
		if _, err := tb.CreatePod(ctx, newPod(ns, name, meshedBroken)); err != nil {
			stopLoop()
			t.Fatal(err)
		}
		names = append(names, name)
		time.Sleep(200 * time.Millisecond)
	}
	// The creation phase lasts until every pod's sandbox is set up (its ADD ran).
	waitFor(t, ctx, 2*time.Minute, "every pod's sandbox set up (pod IP)", func() (bool, error) {
		for _, name := range names {
			p, err := tb.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
			if err != nil || p.Status.PodIP == "" {
				return false, fmt.Errorf("%s: no pod IP yet (%v)", name, err)
			}
		}
		return true, nil
	})
	stopLoop()
	// The loop's last write dropped the entry: the agent puts it back.
	waitEntry(t, ctx)
	t.Logf("primary conflist rewritten %d times while %d pods were created and set up", rewrites(), n)

	var byADD, repaired, runs126 int
	pods := map[string]*corev1.Pod{}
	for _, name := range names {
		pods[name] = waitRunning(t, ctx, tb, ns, name, 3*time.Minute)
	}
	got, fails := a.repairs(), failed()
	for _, name := range names {
		pod := pods[name]
		assertRedirected(t, ctx, pod)
		runs126 += fails[name]
		app := appStatus(t, pod)
		if app.RestartCount != 0 {
			t.Errorf("%s: app container restarted %d times", name, app.RestartCount)
		}
		r, ok := got[ns+"/"+name]
		switch {
		case ok:
			repaired++
			waitEvent(t, ctx, tb, pod, corev1.EventTypeNormal, repair.ReasonRepaired)
			// The app started after the repair (the API stores whole seconds).
			if started := app.State.Running.StartedAt.Time; started.Before(r.time.Truncate(time.Second)) {
				t.Errorf("%s: app started %s, before its repair at %s", name, started, r.time)
			}
			if fails[name] == 0 {
				t.Errorf("%s: repaired without a validation run exiting 126", name)
			}
		case fails[name] > 0:
			t.Errorf("%s: validation exited 126 %d times but the pod runs without a repair", name, fails[name])
		default:
			byADD++
		}
	}
	t.Logf("%d pods audited: redirected by ADD %d, repaired in place %d; validation runs exited 126: %d", n, byADD, repaired, runs126)
}

// rewriteLoop rewrites the test bed's primary conflist (the default one, without
// meshcni's entry) every period by temp + rename, as a primary CNI does, until stop
// is called; count returns how many rewrites it made.
func rewriteLoop(t *testing.T, period time.Duration) (stop func(), count func() int) {
	t.Helper()
	path := filepath.Join(testbed.CNIConfDir, testbed.DefaultConflistName)
	done := make(chan struct{})
	var wg sync.WaitGroup
	var mu sync.Mutex
	n := 0
	wg.Add(1)
	go func() {
		defer wg.Done()
		tick := time.NewTicker(period)
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-tick.C:
				if err := fileutil.WriteFileAtomic(path, testbed.DefaultConflist(), 0o644); err != nil {
					t.Errorf("primary rewrite: %v", err)
				}
				mu.Lock()
				n++
				mu.Unlock()
			}
		}
	}()
	stop = sync.OnceFunc(func() { close(done); wg.Wait() })
	t.Cleanup(stop)
	return stop, func() int { mu.Lock(); defer mu.Unlock(); return n }
}

// waitEntry waits until the test bed's conflist holds meshcni's entry.
func waitEntry(t *testing.T, ctx context.Context) {
	t.Helper()
	path := filepath.Join(testbed.CNIConfDir, testbed.DefaultConflistName)
	waitFor(t, ctx, 30*time.Second, "meshcni's entry in "+path, func() (bool, error) {
		data, err := os.ReadFile(path)
		if err != nil {
			return false, err
		}
		var l struct {
			Plugins []struct {
				Type string `json:"type"`
			} `json:"plugins"`
		}
		if err := json.Unmarshal(data, &l); err != nil {
			return false, fmt.Errorf("parse %s: %w", path, err)
		}
		for _, p := range l.Plugins {
			if p.Type == cniconf.PluginType {
				return true, nil
			}
		}
		return false, nil
	})
}

// exits126 watches the pods of ns from now on and counts, per pod, the runs of its
// validation container that terminated with 126 (distinct container IDs): once a
// later run completes, the API no longer shows the failed one.
func exits126(t *testing.T, ctx context.Context, tb *testbed.Testbed, ns string) (counts func() map[string]int) {
	t.Helper()
	wctx, cancel := context.WithCancel(ctx)
	var mu sync.Mutex
	seen := map[string]map[string]bool{} // pod name → container IDs that exited 126
	note := func(p *corev1.Pod) {
		for _, s := range p.Status.InitContainerStatuses {
			if s.Name != repair.DefaultInitContainer {
				continue
			}
			for _, term := range []*corev1.ContainerStateTerminated{s.State.Terminated, s.LastTerminationState.Terminated} {
				if term != nil && term.ExitCode == 126 {
					mu.Lock()
					if seen[p.Name] == nil {
						seen[p.Name] = map[string]bool{}
					}
					seen[p.Name][term.ContainerID] = true
					mu.Unlock()
				}
			}
		}
	}
	l, err := tb.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	rv := l.ResourceVersion
	done := make(chan struct{})
	go func() {
		defer close(done)
		for wctx.Err() == nil {
			w, err := tb.Client.CoreV1().Pods(ns).Watch(wctx, metav1.ListOptions{ResourceVersion: rv})
			if err != nil {
				time.Sleep(100 * time.Millisecond)
				continue
			}
			for ev := range w.ResultChan() {
				if ev.Type == watch.Error {
					rv = "" // expired: go on from the current state
				}
				if p, ok := ev.Object.(*corev1.Pod); ok {
					rv = p.ResourceVersion
					note(p)
				}
			}
			w.Stop()
		}
	}()
	t.Cleanup(func() { cancel(); <-done })
	return func() map[string]int {
		mu.Lock()
		defer mu.Unlock()
		out := map[string]int{}
		for name, ids := range seen {
			out[name] = len(ids)
		}
		return out
	}
}

// appStatus is the status of the pod's app container.
func appStatus(t *testing.T, pod *corev1.Pod) corev1.ContainerStatus {
	t.Helper()
	for _, s := range pod.Status.ContainerStatuses {
		if s.Name == "app" {
			return s
		}
	}
	t.Fatalf("%s: no app container status", pod.Name)
	return corev1.ContainerStatus{}
}
