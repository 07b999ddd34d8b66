package e2e

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/meshcni/meshcni/internal/env/demo"
	"github.com/meshcni/meshcni/internal/env/istio"
	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/standin/proxysim"
	"github.com/meshcni/meshcni/internal/testkit/agenttest"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/internal/tools/build/image"
	"github.com/meshcni/meshcni/pkg/agent"
	"github.com/meshcni/meshcni/pkg/audit"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/capture/k8spod"
	"github.com/meshcni/meshcni/pkg/cniconf"
	"github.com/meshcni/meshcni/pkg/engine"
)

// escapePeriod is the agent's audit period in TestIstioEscapeWindowClosed (the chart's
// audit.period; its default is 60s).
const escapePeriod = 2 * time.Second

// TestIstioEscapeWindowClosed: the escape window of validation-free pods is closed.
// The chart's agent (audit.period 2s) is paused (SIGSTOP of its process), meshcni's
// entry is removed from the node's conflist behind its back, and a Deployment's
// validation-free meshed pod (the real webhook, the shipped template) starts: its
// sandbox is created without meshcni, so its netns holds no meshcni rule and it has
// no marker label. The agent is resumed (SIGCONT) and restores the conflist itself.
// With audit.escapedAction delete (evict; the chart grants it by name,
// rbac.unfencedPodWrites evict) the audit evicts the pod with a
// Warning Event MeshcniEscapedPod naming it, meshcni_drift_detected_total{reason=
// "no-redirect"} moves, and the Deployment's replacement is redirected (rules as its
// annotations give, the marker label, the app's connection captured by its proxy on
// 15001). With repair, the same pod gets its redirect in place (its proxy captures the
// app's next connection). The times from SIGCONT are logged, with docs/audit.md's bound.
func TestIstioEscapeWindowClosed(t *testing.T) {
	tb := up(t)
	ctx, cancel := context.WithTimeout(context.Background(), 9*time.Minute)
	defer cancel()
	const ns = "istio-e2e-escape"
	injectedNamespace(ctx, t, tb, ns)
	pods, _ := createDeployments(ctx, t, tb, appDeployment(ns, "server", nil))
	dst := podAddr(pods["server"], istio.AppPort)

	defPeriod, defEscaped := chartAuditDefaults(t)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		setAudit(ctx, t, tb, defPeriod, defEscaped)
	})

	setAudit(ctx, t, tb, escapePeriod.String(), string(audit.ActionDelete))
	t.Run("delete", func(t *testing.T) { escapeCase(ctx, t, tb, ns, "escaped-delete", dst, audit.ActionDelete) })
	setAudit(ctx, t, tb, escapePeriod.String(), string(audit.ActionRepair))
	t.Run("repair", func(t *testing.T) { escapeCase(ctx, t, tb, ns, "escaped-repair", dst, audit.ActionRepair) })
}

// escapeCase runs one escape with the agent's escaped action.
func escapeCase(ctx context.Context, t *testing.T, tb *testbed.Testbed, ns, name string, dst netip.AddrPort, action audit.Action) {
	ap := agentPod(ctx, t, tb, escapePeriod.String(), string(action))
	restarts := agentRestarts(ap)
	metricsURL := fmt.Sprintf("http://%s/metrics", netip.AddrPortFrom(netip.MustParseAddr(ap.Status.HostIP), 9807))
	noRedirect := map[string]string{"reason": string(audit.ReasonNoRedirect)}
	before := scrapeValue(t, metricsURL, "meshcni_drift_detected_total", noRedirect)
	handledBefore := scrapeValue(t, metricsURL, "meshcni_drift_repaired_total", noRedirect)
	pid := agentPID(t, ap)
	// The agent's restart (helm upgrade) may have left the not-ready taint for a moment:
	// the pod must not wait for its removal while the agent is paused.
	waitUntil(ctx, t, time.Minute, "the node without the not-ready taint", func() error {
		if hasTaint(t, tb) {
			return errors.New("tainted")
		}
		return nil
	})

	// Pause the agent, take meshcni out of the chain behind its back.
	if err := unix.Kill(pid, unix.SIGSTOP); err != nil {
		t.Fatalf("SIGSTOP agent %d: %v", pid, err)
	}
	resumed := false
	resume := func() time.Time {
		if !resumed {
			resumed = true
			if err := unix.Kill(pid, unix.SIGCONT); err != nil {
				t.Errorf("SIGCONT agent %d: %v", pid, err)
			}
		}
		return time.Now()
	}
	t.Cleanup(func() { resume() })
	file, orig := removeMeshcni(t)
	t.Cleanup(func() {
		if data, err := os.ReadFile(file); err == nil && !hasMeshcni(data) {
			t.Errorf("%s: meshcni still out of the chain at the end; restoring it", file)
			_ = writeFile(file, orig)
		}
	})
	paused := time.Now()

	d := appDeployment(ns, name, map[string]string{istio.AnnotationTemplates: validationFreeTemplates})
	if _, err := tb.Client.AppsV1().Deployments(ns).Create(ctx, d, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create Deployment %s: %v", name, err)
	}
	p := appStarted(ctx, t, tb, ns, name, "")
	checkValidationFree(t, p)
	netns, err := tb.PodNetns(ctx, ns, p.Name)
	if err != nil {
		t.Fatal(err)
	}
	if live := liveRules(ctx, t, netns); live != "" {
		t.Fatalf("%s started with meshcni out of the chain, yet its netns holds meshcni rules:\n%s", p.Name, live)
	}
	if v, ok := p.Labels[agent.RedirectedLabel]; ok {
		t.Errorf("%s: unredirected, yet labelled %s=%s", p.Name, agent.RedirectedLabel, v)
	}
	t.Logf("%s (uid %s) started unredirected: no meshcni rule in %s, no %s label (agent paused for %v)",
		p.Name, p.UID, netns, agent.RedirectedLabel, time.Since(paused).Round(time.Millisecond))

	began := resume()
	bound := time.Duration(1.85 * float64(escapePeriod))
	wait := bound + 15*time.Second // the agent catching up after SIGCONT, the API's latency
	conflistBack := waitUntil(ctx, t, wait, "the agent puts meshcni back into "+file, func() error {
		data, err := os.ReadFile(file)
		if err != nil {
			return err
		}
		if !hasMeshcni(data) {
			return errors.New("no meshcni entry")
		}
		return nil
	})
	t.Logf("agent resumed: meshcni back in %s after %v", filepath.Base(file), conflistBack.Sub(began).Round(time.Millisecond))

	var msg string
	evAt := waitUntil(ctx, t, wait, "Event "+audit.EventEscaped+" on "+p.Name, func() error {
		m, err := podWarning(ctx, tb, p, audit.EventEscaped)
		msg = m
		return err
	})
	if !strings.Contains(msg, "no meshcni redirect at all") {
		t.Errorf("%s: Event message %q: want the escape named", p.Name, msg)
	}
	switch action {
	case audit.ActionDelete:
		if !strings.Contains(msg, "pod evicted") {
			t.Errorf("%s: Event message %q: want the eviction", p.Name, msg)
		}
		gone := waitUntil(ctx, t, wait, p.Name+" deleted", func() error {
			got, err := tb.Client.CoreV1().Pods(ns).Get(ctx, p.Name, metav1.GetOptions{})
			if apierrors.IsNotFound(err) || (err == nil && (got.UID != p.UID || got.DeletionTimestamp != nil)) {
				return nil
			}
			return fmt.Errorf("still there: %v", err)
		})
		t.Logf("%s: Event %s %q %v after SIGCONT; deleted %v after SIGCONT (docs/audit.md's bound at audit.period %v: %v)",
			p.Name, audit.EventEscaped, msg, evAt.Sub(began).Round(time.Millisecond), gone.Sub(began).Round(time.Millisecond), escapePeriod, bound)

		r := appStarted(ctx, t, tb, ns, name, string(p.UID))
		wctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
		defer cancel()
		if r, err = tb.WaitPodReady(wctx, ns, r.Name); err != nil {
			t.Fatal(err)
		}
		t.Logf("replacement %s (uid %s) Ready %v after SIGCONT", r.Name, r.UID, time.Since(began).Round(time.Millisecond))
		checkRedirected(ctx, t, tb, r)
		waitLabel(ctx, t, tb, r, agent.RedirectedValue)
		throughProxy(ctx, t, tb, r, dst)
	case audit.ActionRepair:
		if !strings.Contains(msg, "re-applied in place") {
			t.Errorf("%s: Event message %q: want the repair in place", p.Name, msg)
		}
		got, err := tb.Client.CoreV1().Pods(ns).Get(ctx, p.Name, metav1.GetOptions{})
		if err != nil || got.UID != p.UID || got.DeletionTimestamp != nil {
			t.Fatalf("%s: repaired in place, yet gone or replaced: %v", p.Name, err)
		}
		checkRedirected(ctx, t, tb, got)
		t.Logf("%s: Event %s %q and redirect in place %v after SIGCONT (docs/audit.md's bound at audit.period %v: %v)",
			p.Name, audit.EventEscaped, msg, evAt.Sub(began).Round(time.Millisecond), escapePeriod, bound)
		throughProxy(ctx, t, tb, got, dst)
	}

	after := scrapeValue(t, metricsURL, "meshcni_drift_detected_total", noRedirect)
	if after < before+1 {
		t.Errorf(`meshcni_drift_detected_total{reason="no-redirect"}: %v before, %v after; want it to move`, before, after)
	}
	handled := scrapeValue(t, metricsURL, "meshcni_drift_repaired_total", noRedirect)
	if handled < handledBefore+1 {
		t.Errorf(`meshcni_drift_repaired_total{reason="no-redirect"}: %v before, %v after; want it to move`, handledBefore, handled)
	}
	t.Logf(`meshcni_drift_detected_total{reason="no-redirect"}: %v → %v; meshcni_drift_repaired_total: %v → %v`, before, after, handledBefore, handled)
	if now := agentPod(ctx, t, tb, escapePeriod.String(), string(action)); now.UID != ap.UID || agentRestarts(now) != restarts {
		t.Errorf("the agent was restarted while paused (pod %s → %s, restarts %d → %d): the kubelet's liveness probe acted", ap.UID, now.UID, restarts, agentRestarts(now))
	}
}

// chartAuditDefaults reads audit.period and audit.escapedAction from the chart's values.
func chartAuditDefaults(t *testing.T) (period, escaped string) {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(upRoot, demo.ChartDir, "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var v struct {
		Audit struct {
			Period        string `json:"period"`
			EscapedAction string `json:"escapedAction"`
		} `json:"audit"`
	}
	if err := yaml.Unmarshal(data, &v); err != nil || v.Audit.Period == "" || v.Audit.EscapedAction == "" {
		t.Fatalf("chart values: audit %+v: %v", v.Audit, err)
	}
	return v.Audit.Period, v.Audit.EscapedAction
}

// setAudit sets the chart's audit.period and audit.escapedAction (helm upgrade
// --reuse-values; delete or evict with the grant the chart asks for by name,
// rbac.unfencedPodWrites evict) and waits for the agent pod running with them.
func setAudit(ctx context.Context, t *testing.T, tb *testbed.Testbed, period, escaped string) {
	t.Helper()
	helm, err := demo.HelmPath(ctx, upRoot)
	if err != nil {
		t.Fatal(err)
	}
	args := []string{"upgrade", demo.Release, filepath.Join(upRoot, demo.ChartDir), "--namespace", demo.ReleaseNamespace, "--reuse-values",
		"--set-string", "audit.period=" + period, "--set-string", "audit.escapedAction=" + escaped, "--set-json", "rbac.unfencedPodWrites=[]"}
	if escaped == "delete" || escaped == "evict" {
		args[len(args)-1] = `rbac.unfencedPodWrites=["evict"]`
	}
	cmd := exec.CommandContext(ctx, helm, args...)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+testbed.KubeconfigPath())
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("helm %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	wctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	if _, err := tb.WaitDaemonSet(wctx, demo.ReleaseNamespace, "meshcni-agent"); err != nil {
		t.Fatal(err)
	}
	agentPod(ctx, t, tb, period, escaped)
	t.Logf("agent: audit.period %s, audit.escapedAction %s", period, escaped)
}

// agentPod waits for the one agent pod, Ready and not being deleted, whose
// environment has the audit period and escaped action.
func agentPod(ctx context.Context, t *testing.T, tb *testbed.Testbed, period, escaped string) *corev1.Pod {
	t.Helper()
	var p *corev1.Pod
	waitUntil(ctx, t, 2*time.Minute, "the agent pod Ready with audit "+period+" "+escaped, func() error {
		l, err := tb.Client.CoreV1().Pods(demo.ReleaseNamespace).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=agent"})
		if err != nil {
			return err
		}
		var found []*corev1.Pod
		for i := range l.Items {
			q := &l.Items[i]
			if q.DeletionTimestamp == nil && podReady(q) && agentEnv(q, "MESHCNI_AUDIT_PERIOD") == period &&
				agentEnv(q, "MESHCNI_AUDIT_ESCAPED_ACTION") == escaped {
				found = append(found, q)
			}
		}
		if len(l.Items) != 1 || len(found) != 1 {
			return fmt.Errorf("%d agent pods, %d Ready with these settings", len(l.Items), len(found))
		}
		p = found[0]
		return nil
	})
	return p
}

func agentEnv(p *corev1.Pod, name string) string {
	for _, c := range p.Spec.Containers {
		for _, e := range c.Env {
			if e.Name == name {
				return e.Value
			}
		}
	}
	return ""
}

func agentRestarts(p *corev1.Pod) int32 {
	var n int32
	for _, s := range p.Status.ContainerStatuses {
		n += s.RestartCount
	}
	return n
}

// agentPID finds the process of the agent pod's agent container on the node.
func agentPID(t *testing.T, p *corev1.Pod) int {
	t.Helper()
	pid, err := testbed.ContainerProcess(p, "agent", image.AgentCommand)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("agent pod %s: process %d", p.Name, pid)
	return pid
}

// removeMeshcni removes meshcni's entry from the conflist of the test bed's node that
// holds it (temp file + rename, as another writer would) and returns the file and its
// former content.
func removeMeshcni(t *testing.T) (string, []byte) {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(testbed.CNIConfDir, "*.conflist"))
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		out, removed, err := cniconf.Remove(data)
		if err != nil || removed == 0 {
			continue
		}
		if err := writeFile(f, out); err != nil {
			t.Fatal(err)
		}
		t.Logf("%s: meshcni's entry removed", f)
		return f, data
	}
	t.Fatalf("no conflist in %s holds meshcni", testbed.CNIConfDir)
	return "", nil
}

func hasMeshcni(data []byte) bool {
	_, removed, err := cniconf.Remove(data)
	return err == nil && removed > 0
}

func writeFile(path string, data []byte) error {
	tmp := path + ".escape-test.tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return fmt.Errorf("write %s: %w", tmp, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("rename %s: %w", tmp, err)
	}
	return nil
}

// appStarted waits for the pod of Deployment name (other than the pod with UID
// not) whose app container runs.
func appStarted(ctx context.Context, t *testing.T, tb *testbed.Testbed, ns, name string, not string) *corev1.Pod {
	t.Helper()
	var p *corev1.Pod
	waitUntil(ctx, t, 2*time.Minute, "the app container of a pod of "+name+" running", func() error {
		l, err := tb.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: "app=" + name})
		if err != nil {
			return err
		}
		for i := range l.Items {
			q := &l.Items[i]
			if string(q.UID) == not || q.DeletionTimestamp != nil || q.Status.PodIP == "" {
				continue
			}
			for _, s := range q.Status.ContainerStatuses {
				if s.Name == istio.AppContainer && s.State.Running != nil {
					p = q
					return nil
				}
			}
		}
		return fmt.Errorf("%d pods, none running its app", len(l.Items))
	})
	return p
}

// liveRules returns meshcni's live rules in the netns, of every backend ("" : none).
func liveRules(ctx context.Context, t *testing.T, netns string) string {
	t.Helper()
	live, err := engine.Live(ctx, engine.Options{NetnsPath: netns})
	if err != nil {
		t.Fatalf("live rules in %s: %v", netns, err)
	}
	var b strings.Builder
	for k, txt := range live {
		if strings.TrimSpace(txt) != "" {
			fmt.Fprintf(&b, "%s:\n%s\n", k, txt)
		}
	}
	return b.String()
}

// checkRedirected: the pod's netns holds exactly the redirect its annotations give.
func checkRedirected(ctx context.Context, t *testing.T, tb *testbed.Testbed, p *corev1.Pod) {
	t.Helper()
	netns, err := tb.PodNetns(ctx, p.Namespace, p.Name)
	if err != nil {
		t.Fatal(err)
	}
	res, err := capture.ForPod(k8spod.From(p), []netip.Addr{netip.MustParseAddr(p.Status.PodIP)})
	if err != nil {
		t.Fatal(err)
	}
	var last string
	waitUntil(ctx, t, 20*time.Second, p.Name+"'s redirect in place", func() error {
		r, err := engine.CheckReport(ctx, engine.Options{NetnsPath: netns}, res.Spec)
		if err != nil {
			return err
		}
		if len(r.Findings) > 0 || !r.Drift.Empty() {
			last = r.Describe()
			return fmt.Errorf("drift: %s", last)
		}
		return nil
	})
	if liveRules(ctx, t, netns) == "" {
		t.Errorf("%s: no meshcni rule in %s", p.Name, netns)
	}
	t.Logf("%s: the redirect its annotations give is in %s", p.Name, netns)
}

// throughProxy: a connection from the pod's app container to dst is captured by its
// own proxy on 15001 with dst as original destination.
func throughProxy(ctx context.Context, t *testing.T, tb *testbed.Testbed, p *corev1.Pod, dst netip.AddrPort) {
	t.Helper()
	if res := probe(ctx, t, tb, p, dst); !res.Connected || res.Error != "" {
		t.Fatalf("%s → %v: %+v", p.Name, dst, res)
	}
	r, _ := waitRecord(ctx, t, tb, p, "the app's connection captured on 15001", conn(proxysim.ListenerOutbound, dst))
	if r.Local.Port() != 15001 {
		t.Errorf("%s: outbound record %+v; want local port 15001", p.Name, r)
	}
	t.Logf("%s: the app's connection to %v captured by its proxy on %v", p.Name, dst, r.Local)
}

// podWarning returns the message of the pod's (by UID) Warning Event with reason.
func podWarning(ctx context.Context, tb *testbed.Testbed, p *corev1.Pod, reason string) (string, error) {
	evs, err := tb.Client.CoreV1().Events(p.Namespace).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.uid=" + string(p.UID)})
	if err != nil {
		return "", err
	}
	for _, e := range evs.Items {
		if e.Reason == reason && e.Type == corev1.EventTypeWarning {
			if e.InvolvedObject.Kind != "Pod" || e.InvolvedObject.Name != p.Name {
				return "", fmt.Errorf("Event %s names %s %q", reason, e.InvolvedObject.Kind, e.InvolvedObject.Name)
			}
			return e.Message, nil
		}
	}
	var seen []string
	for _, e := range evs.Items {
		seen = append(seen, e.Reason+": "+e.Message)
	}
	return "", fmt.Errorf("%d events, none %s: %q", len(evs.Items), reason, seen)
}

// scrapeValue reads one sample of the agent's metrics (0 when absent).
func scrapeValue(t *testing.T, url, name string, labels map[string]string) float64 {
	t.Helper()
	code, body, err := agenttest.Get(url)
	if err != nil || code != http.StatusOK {
		t.Fatalf("scrape %s: %d %v", url, code, err)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(strings.NewReader(body))
	if err != nil {
		t.Fatalf("parse %s: %v", url, err)
	}
	v, _ := agenttest.Value(fams, name, labels)
	return v
}

// waitUntil polls f every 100 ms until it returns nil (the time it did) or d passes
// (fatal, with f's last error).
func waitUntil(ctx context.Context, t *testing.T, d time.Duration, what string, f func() error) time.Time {
	t.Helper()
	return testutil.PollUntil(ctx, t, d, 100*time.Millisecond, what, f)
}
