package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/internal/env/demo"
	"github.com/meshcni/meshcni/internal/env/testbed"
)

const (
	badNamespace   = "istio-e2e-bad-input"
	badRawNS       = "istio-e2e-bad-input-raw" // no injection label
	annMode        = "sidecar.istio.io/interceptionMode"
	annExcludeOut  = "traffic.sidecar.istio.io/excludeOutboundPorts"
	annIncludeOut  = "traffic.sidecar.istio.io/includeOutboundPorts"
	sandboxFailure = "FailedCreatePodSandBox"
)

// TestIstioBadInput: broken per-pod input never yields a pod started without its
// redirect.
//   - The real injector validates interceptionMode and excludeOutboundPorts itself:
//     a pod with `BOGUS` or `80,abc` is refused at admission with a message naming
//     the annotation (the webhook path ends there).
//   - includeOutboundPorts is copied through unvalidated (annotation and `-q`): a pod
//     with `80,abc` is injected, and meshcni's plugin fails its sandbox: a
//     FailedCreatePodSandBox Event naming the annotation, no pod IP, and the plugin's
//     "ADD failed" line in the agent's log with the pod's name and the reason.
//   - An injected pod edited afterwards to interceptionMode BOGUS (istioctl
//     kube-inject output, applied as a bare Pod): the same, naming interceptionMode.
func TestIstioBadInput(t *testing.T) {
	tb := upParallel(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	injectedNamespace(ctx, t, tb, badNamespace)
	if err := tb.CreateNamespace(ctx, badRawNS); err != nil {
		t.Fatal(err)
	}
	useNamespace(t, tb, badRawNS)

	for _, c := range []struct{ ann, value string }{{annMode, "BOGUS"}, {annExcludeOut, "80,abc"}} {
		p := podOf(appDeployment(badNamespace, "x", map[string]string{c.ann: c.value}), "refused-"+strings.ToLower(strings.Split(c.ann, "/")[1]))
		_, err := tb.Client.CoreV1().Pods(badNamespace).Create(ctx, p, metav1.CreateOptions{})
		if err == nil || !strings.Contains(err.Error(), c.ann) || !strings.Contains(err.Error(), c.value) {
			t.Errorf("%s=%q: create = %v, want the injector's refusal naming the annotation and the value", c.ann, c.value, err)
			continue
		}
		t.Logf("%s=%q refused by the injector: %v", c.ann, c.value, err)
	}

	p := podOf(appDeployment(badNamespace, "x", map[string]string{annIncludeOut: "80,abc"}), "bad-include-outbound")
	created, err := tb.Client.CoreV1().Pods(badNamespace).Create(ctx, p, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("%s=80,abc: %v (the injector copies it through)", annIncludeOut, err)
	}
	if created.Annotations[annIncludeOut] != "80,abc" {
		t.Errorf("injected annotations %v: want %s=80,abc copied through", created.Annotations, annIncludeOut)
	}
	checkArg(t, created, "-q", "80,abc")
	checkSandboxRefused(ctx, t, tb, created, annIncludeOut, "80,abc")

	kd := kubeInject(ctx, t, tb, appDeployment(badRawNS, "x", kubeInjectTemplates()))
	bp := podOf(kd, "bad-mode-after-injection")
	bp.Annotations[annMode] = "BOGUS"
	created, err = tb.Client.CoreV1().Pods(badRawNS).Create(ctx, bp, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	checkSandboxRefused(ctx, t, tb, created, annMode, "BOGUS")
}

// checkSandboxRefused waits for the pod's FailedCreatePodSandBox Event naming the
// annotation and value, asserts the pod has no IP and is not running, and finds the
// plugin's "ADD failed" record for the pod in the agent's log.
func checkSandboxRefused(ctx context.Context, t *testing.T, tb *testbed.Testbed, p *corev1.Pod, ann, value string) {
	t.Helper()
	var ev corev1.Event
	deadline := time.Now().Add(time.Minute)
	for {
		evs, err := tb.Client.CoreV1().Events(p.Namespace).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + p.Name})
		if err == nil {
			i := slices.IndexFunc(evs.Items, func(e corev1.Event) bool { return e.Reason == sandboxFailure })
			if i >= 0 {
				ev = evs.Items[i]
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: no %s Event within 1m (%v)", p.Name, sandboxFailure, err)
		}
		time.Sleep(250 * time.Millisecond)
	}
	t.Logf("%s: %s: %s", p.Name, ev.Reason, ev.Message)
	if !strings.Contains(ev.Message, ann) || !strings.Contains(ev.Message, value) || !strings.Contains(ev.Message, "no redirect rule was applied") {
		t.Errorf("%s: Event message %q: want the annotation %s, the value %q and that no rule was applied", p.Name, ev.Message, ann, value)
	}
	cur, err := tb.Client.CoreV1().Pods(p.Namespace).Get(ctx, p.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if cur.Status.PodIP != "" || cur.Status.Phase == corev1.PodRunning {
		t.Errorf("%s: phase %s, IP %q: want no sandbox (no IP, not running)", p.Name, cur.Status.Phase, cur.Status.PodIP)
	}
	line := agentLogLine(ctx, t, tb, func(l map[string]any) bool {
		return l["source"] == "plugin" && l["pod_name"] == p.Name && l["pod_namespace"] == p.Namespace &&
			l["msg"] == "ADD failed" && strings.Contains(fmt.Sprint(l["err"]), ann)
	})
	t.Logf("%s: agent log: %s", p.Name, line)
}

// agentLogLine polls meshcni's agent log for a JSON line matching match.
func agentLogLine(ctx context.Context, t *testing.T, tb *testbed.Testbed, match func(map[string]any) bool) string {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	var all string
	for {
		pods, err := tb.Client.CoreV1().Pods(demo.ReleaseNamespace).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/instance=" + demo.Release})
		if err == nil {
			for _, ap := range pods.Items {
				if len(ap.OwnerReferences) == 0 || ap.OwnerReferences[0].Kind != "DaemonSet" {
					continue
				}
				logs, err := tb.PodLogs(ctx, ap.Namespace, ap.Name, ap.Spec.Containers[0].Name)
				if err != nil {
					continue
				}
				all = logs
				for _, line := range strings.Split(logs, "\n") {
					var l map[string]any
					if json.Unmarshal([]byte(line), &l) == nil && match(l) {
						return line
					}
				}
			}
		}
		if time.Now().After(deadline) {
			t.Errorf("no matching plugin record in the agent's log; its tail:\n%s", tail(all, 30))
			return ""
		}
		time.Sleep(500 * time.Millisecond)
	}
}

func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
