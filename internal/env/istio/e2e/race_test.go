package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/meshcni/meshcni/internal/env/demo"
	"github.com/meshcni/meshcni/internal/env/istio"
	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/tools/build/image"
	"github.com/meshcni/meshcni/pkg/redirectprobe"
	"github.com/meshcni/meshcni/pkg/repair"
)

const (
	raceNamespace = "istio-e2e-race"
	// agentOffLabel is a node selector no node matches: the agent's DaemonSet then
	// runs no pod, and the agent, stopped with SIGTERM and --keep-on-exit never, takes
	// meshcni out of the chain (with the default auto it would keep the plugin: its
	// DaemonSet still exists).
	agentOffLabel = "meshcni-e2e/agent-off"
)

// TestIstioRace: meshed pods are scheduled while meshcni is not in the node's CNI
// chain (the agent's DaemonSet is moved off the node; the agent removes its entry on
// SIGTERM), so Istio's own istio-validation exits 126 in each; then the agent comes
// back and its repair controller (the chart's default, in place) repairs them: the
// next istio-validation run exits 0, the pods go Ready, and client → server TCP is
// captured on both sides. The time from the agent's DaemonSet ready to all pods
// Ready is logged, not bounded.
func TestIstioRace(t *testing.T) {
	tb := up(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	ds := agentDaemonSet(ctx, t, tb)
	injectedNamespace(ctx, t, tb, raceNamespace)

	stopped := time.Now()
	setAgentOff(ctx, t, tb, ds, true)
	t.Cleanup(func() { restoreAgent(t, tb, ds) })
	waitChain(ctx, t, tb, ds, false)
	t.Logf("agent stopped, meshcni out of %s in %s", testbed.DefaultConflistName, time.Since(stopped).Round(time.Millisecond))

	names := []string{"server", "client", "third"}
	created := time.Now()
	for _, n := range names {
		if _, err := tb.Client.AppsV1().Deployments(raceNamespace).Create(ctx, istio.Deployment(raceNamespace, n), metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	for _, n := range names {
		p := waitPod(ctx, t, tb, n, "istio-validation to exit 126", func(p *corev1.Pod) bool {
			return initExit(p, "istio-validation") == redirectprobe.ExitCode
		})
		checkInjected126(t, p)
	}
	t.Logf("istio-validation exited %d in all %d pods %s after they were created", redirectprobe.ExitCode, len(names), time.Since(created).Round(time.Millisecond))

	setAgentOff(ctx, t, tb, ds, false)
	wctx, wcancel := context.WithTimeout(ctx, 3*time.Minute)
	defer wcancel()
	if _, err := tb.WaitDaemonSet(wctx, demo.ReleaseNamespace, ds); err != nil {
		t.Fatal(err)
	}
	agentReady := time.Now()
	waitChain(ctx, t, tb, ds, true)
	pods := map[string]*corev1.Pod{}
	for _, n := range names {
		pods[n] = waitPod(ctx, t, tb, n, "Ready", podReady)
	}
	t.Logf("all %d pods Ready %s after the agent's DaemonSet was ready (%s after meshcni was taken out)",
		len(names), time.Since(agentReady).Round(time.Millisecond), time.Since(stopped).Round(time.Millisecond))
	for _, p := range pods {
		checkRepaired(ctx, t, tb, p)
	}
	checkTraffic(ctx, t, tb, &istio.App{Namespace: raceNamespace, Client: pods["client"], Server: pods["server"]})
}

func agentDaemonSet(ctx context.Context, t *testing.T, tb *testbed.Testbed) string {
	t.Helper()
	l, err := tb.Client.AppsV1().DaemonSets(demo.ReleaseNamespace).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/instance=" + demo.Release})
	if err != nil || len(l.Items) != 1 {
		t.Fatalf("meshcni's agent DaemonSet: %d found, %v", len(l.Items), err)
	}
	return l.Items[0].Name
}

// setAgentOff adds (off) or removes the node selector no node matches.
func setAgentOff(ctx context.Context, t *testing.T, tb *testbed.Testbed, ds string, off bool) {
	t.Helper()
	patchDS := func(spec map[string]any) {
		t.Helper()
		patch, _ := json.Marshal(map[string]any{"spec": map[string]any{"template": map[string]any{"spec": spec}}})
		if _, err := tb.Client.AppsV1().DaemonSets(demo.ReleaseNamespace).Patch(ctx, ds, types.StrategicMergePatchType, patch, metav1.PatchOptions{}); err != nil {
			t.Fatalf("patch DaemonSet %s (off=%v): %v", ds, off, err)
		}
	}
	keep := func(mode string) []any {
		return []any{map[string]any{"name": "agent", "env": []any{map[string]any{"name": "MESHCNI_KEEP_ON_EXIT", "value": mode}}}}
	}
	if !off {
		patchDS(map[string]any{"nodeSelector": map[string]any{agentOffLabel: nil}, "containers": keep("auto")})
		return
	}
	// First an agent that removes the plugin when it stops, then no agent.
	patchDS(map[string]any{"containers": keep("never")})
	wctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	if _, err := tb.WaitDaemonSet(wctx, demo.ReleaseNamespace, ds); err != nil {
		t.Fatalf("agent with --keep-on-exit never: %v", err)
	}
	patchDS(map[string]any{"nodeSelector": map[string]any{agentOffLabel: "true"}})
}

// restoreAgent brings the agent back (if the test stopped early), and waits for its
// plugin in the chain and the node without the not-ready taint, for the next test.
func restoreAgent(t *testing.T, tb *testbed.Testbed, ds string) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	setAgentOff(ctx, t, tb, ds, false)
	if _, err := tb.WaitDaemonSet(ctx, demo.ReleaseNamespace, ds); err != nil {
		t.Error(err)
	}
	waitChain(ctx, t, tb, ds, true)
	for {
		n, err := tb.Client.CoreV1().Nodes().Get(ctx, testbed.NodeName, metav1.GetOptions{})
		if err == nil && !slices.ContainsFunc(n.Spec.Taints, func(tt corev1.Taint) bool { return tt.Key == demo.NotReadyTaint }) {
			return
		}
		select {
		case <-ctx.Done():
			t.Errorf("node %s keeps taint %s", testbed.NodeName, demo.NotReadyTaint)
			return
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// waitChain waits until meshcni is (in) or is not in the node's CNI chain, and, when
// out, no agent pod is left.
func waitChain(ctx context.Context, t *testing.T, tb *testbed.Testbed, ds string, in bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	var state string
	for {
		got, err := inChain()
		agents := -1
		if l, lerr := tb.Client.CoreV1().Pods(demo.ReleaseNamespace).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/instance=" + demo.Release}); lerr == nil {
			agents = 0
			for _, p := range l.Items {
				if len(p.OwnerReferences) > 0 && p.OwnerReferences[0].Name == ds {
					agents++
				}
			}
		}
		if err == nil && got == in && (in || agents == 0) {
			return
		}
		state = fmt.Sprintf("in chain %v (%v), agent pods %d", got, err, agents)
		select {
		case <-ctx.Done():
			t.Fatalf("meshcni in the chain: want %v, have %s", in, state)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// inChain says whether the node's conflist has meshcni's entry.
func inChain() (bool, error) {
	b, err := os.ReadFile(filepath.Join(testbed.CNIConfDir, testbed.DefaultConflistName))
	if err != nil {
		return false, err
	}
	var conf struct {
		Plugins []struct {
			Type string `json:"type"`
		} `json:"plugins"`
	}
	if err := json.Unmarshal(b, &conf); err != nil {
		return false, err
	}
	return slices.ContainsFunc(conf.Plugins, func(p struct {
		Type string `json:"type"`
	}) bool {
		return p.Type == image.PluginCommand
	}), nil
}

func podReady(p *corev1.Pod) bool {
	return slices.ContainsFunc(p.Status.Conditions, func(c corev1.PodCondition) bool {
		return c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue
	})
}

// waitPod polls the one pod of Deployment name until cond holds.
func waitPod(ctx context.Context, t *testing.T, tb *testbed.Testbed, name, what string, cond func(*corev1.Pod) bool) *corev1.Pod {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	var last *corev1.Pod
	for {
		l, err := tb.Client.CoreV1().Pods(raceNamespace).List(ctx, metav1.ListOptions{LabelSelector: "app=" + name})
		if err == nil && len(l.Items) == 1 {
			last = &l.Items[0]
			if cond(last) {
				return last
			}
		}
		select {
		case <-ctx.Done():
			t.Fatalf("pod of %s: %s: not within 3m; last status %+v", name, what, statusOf(last))
		case <-time.After(250 * time.Millisecond):
		}
	}
}

func statusOf(p *corev1.Pod) any {
	if p == nil {
		return nil
	}
	return p.Status
}

// checkInjected126: the failing pod was injected by istiod and it is Istio's own
// istio-validation (the proxyv2 image's pilot-agent) that exited 126.
func checkInjected126(t *testing.T, p *corev1.Pod) {
	t.Helper()
	if _, ok := p.Annotations["sidecar.istio.io/status"]; !ok {
		t.Errorf("%s: not injected", p.Name)
	}
	if v := container(p, "istio-validation"); v == nil || v.Image != istio.ProxyImage {
		t.Errorf("%s: istio-validation is not Istio's pilot-agent (%s)", p.Name, istio.ProxyImage)
	}
	if podReady(p) {
		t.Errorf("%s: Ready without meshcni in the chain", p.Name)
	}
}

// checkRepaired: the pod's current istio-validation run exited 0 after a failed
// one, and the repair controller recorded that it repaired the pod in place.
func checkRepaired(ctx context.Context, t *testing.T, tb *testbed.Testbed, p *corev1.Pod) {
	t.Helper()
	for _, s := range p.Status.InitContainerStatuses {
		if s.Name == "istio-validation" && (s.State.Terminated == nil || s.State.Terminated.ExitCode != 0 || s.RestartCount < 1) {
			t.Errorf("%s: istio-validation %+v (restarts %d): want a run exiting 0 after the failed one", p.Name, s.State, s.RestartCount)
		}
	}
	evs, err := tb.Client.CoreV1().Events(p.Namespace).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + p.Name})
	if err != nil {
		t.Fatal(err)
	}
	i := slices.IndexFunc(evs.Items, func(e corev1.Event) bool { return e.Reason == repair.ReasonRepaired })
	if i < 0 {
		t.Errorf("%s: no %s Event", p.Name, repair.ReasonRepaired)
		return
	}
	t.Logf("%s: %s: %s", p.Name, evs.Items[i].Reason, evs.Items[i].Message)
}
