package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/internal/env/istio"
	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/standin/proxysim"
	"github.com/meshcni/meshcni/pkg/agent"
)

// The shipped values snippet (istiod's chart; the shared install adds it) and the
// injection template it defines.
const (
	validationFreeValues   = "deploy/istio/validation-free-values.yaml"
	validationFreeTemplate = "meshcni-validation-free"
)

// validationFreeTemplates is the inject.istio.io/templates annotation of a
// validation-free pod on the test bed: Istio's sidecar, the template that removes
// istio-validation, and the test bed's hostAliases (the annotation replaces the
// defaultTemplates, which name it).
var validationFreeTemplates = strings.Join([]string{"sidecar", validationFreeTemplate, istio.HostAliasesTemplate}, ",")

// TestIstioValidationFree: a pod injected by the real webhook with the shipped
// validation-free template has no istio-validation (its only init container is the
// istio-proxy native sidecar), and its app container's entrypoint is a TCP connect to
// the server, its very first action: that connection, the container's first and only
// one (restartPolicy Never, 0 restarts), is in the pod's own proxy's records as
// captured on 15001 with the server as original destination, and arrives at the
// server's proxy on 15006 from the client's pod IP. The agent labels both meshed pods
// meshcni.io/redirected=true and leaves a pod without sidecar unlabelled.
func TestIstioValidationFree(t *testing.T) {
	tb := upParallel(t)
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	const ns = "istio-e2e-validation-free"
	injectedNamespace(ctx, t, tb, ns)

	plain := appDeployment(ns, "plain", nil)
	plain.Spec.Template.Labels["sidecar.istio.io/inject"] = "false"
	pods, _ := createDeployments(ctx, t, tb, appDeployment(ns, "server", nil), plain)
	server := pods["server"]
	dst := podAddr(server, istio.AppPort)

	client := firstConnectPod(ns, "client", dst)
	if _, err := tb.Client.CoreV1().Pods(ns).Create(ctx, client, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create pod %s: %v", client.Name, err)
	}
	p := waitAppExited(ctx, t, tb, ns, client.Name)
	checkValidationFree(t, p)

	logs, err := tb.PodLogs(ctx, ns, p.Name, istio.AppContainer)
	if err != nil {
		t.Fatal(err)
	}
	var res proxysim.ProbeResult
	if err := json.Unmarshal([]byte(strings.TrimSpace(logs)), &res); err != nil {
		t.Fatalf("%s: app log %q: %v", p.Name, logs, err)
	}
	if !res.Connected || res.Error != "" {
		t.Fatalf("%s: the app's first connection to %v: %+v", p.Name, dst, res)
	}
	clientIP := netip.MustParseAddr(p.Status.PodIP)
	out, recs := waitRecord(ctx, t, tb, p, "the app's first connection captured on 15001", conn(proxysim.ListenerOutbound, dst))
	if out.Local.Port() != 15001 || out.Peer.Addr() != clientIP {
		t.Errorf("%s: outbound record %+v; want local port 15001, peer %v", p.Name, out, clientIP)
	}
	if n := countConn(recs, proxysim.ListenerOutbound, dst); n != 1 {
		t.Errorf("%s: %d outbound records to %v, want the app's one connection", p.Name, n, dst)
	}
	in, _ := waitRecord(ctx, t, tb, server, "the client's connection captured on 15006", func(r proxysim.Record) bool {
		return conn(proxysim.ListenerInbound, dst)(r) && r.Peer.Addr() == clientIP
	})
	t.Logf("%s: the app's first connection (its entrypoint) to %v captured by its proxy on %v, arrived at %s's proxy on %v; app saw %+v",
		p.Name, dst, out.Local, server.Name, in.Local, res)

	for _, w := range []struct {
		pod  *corev1.Pod
		want string
	}{{p, agent.RedirectedValue}, {server, agent.RedirectedValue}} {
		waitLabel(ctx, t, tb, w.pod, w.want)
	}
	// The plain pod's ADD was long before the client's, whose label is set: the
	// marker has passed it by.
	got, err := tb.Client.CoreV1().Pods(ns).Get(ctx, pods["plain"].Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if v, ok := got.Labels[agent.RedirectedLabel]; ok {
		t.Errorf("%s (no sidecar): labelled %s=%s", got.Name, agent.RedirectedLabel, v)
	}
}

// firstConnectPod is a pod whose app container's entrypoint connects to dst at once
// (/proxysim client, as istio.AppUID), injected with the validation-free template;
// restartPolicy Never, so the app runs once.
func firstConnectPod(ns, name string, dst netip.AddrPort) *corev1.Pod {
	d := istio.Deployment(ns, name)
	spec := d.Spec.Template.Spec
	spec.RestartPolicy = corev1.RestartPolicyNever
	c := &spec.Containers[0]
	c.Command = []string{"/proxysim", "client", "--connect", dst.String(), "--send", "hello\n"}
	c.Args, c.Ports, c.ReadinessProbe = nil, nil, nil
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: d.Spec.Template.Labels,
			Annotations: map[string]string{istio.AnnotationTemplates: validationFreeTemplates}},
		Spec: spec,
	}
}

// waitAppExited waits until the pod's app container has terminated.
func waitAppExited(ctx context.Context, t *testing.T, tb *testbed.Testbed, ns, name string) *corev1.Pod {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	var last *corev1.Pod
	for {
		p, err := tb.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err == nil {
			last = p
			for _, s := range p.Status.ContainerStatuses {
				if s.Name == istio.AppContainer && s.State.Terminated != nil {
					if s.State.Terminated.ExitCode != 0 || s.RestartCount != 0 {
						t.Fatalf("%s: app exited %d after %d restarts", name, s.State.Terminated.ExitCode, s.RestartCount)
					}
					return p
				}
			}
		}
		select {
		case <-ctx.Done():
			t.Fatalf("%s: app container not done: %v; last status %+v", name, ctx.Err(), statusOf(last))
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// checkValidationFree: the webhook injected istio-proxy (a native sidecar) and no
// istio-validation nor istio-init; the pod ran no other init container.
func checkValidationFree(t *testing.T, p *corev1.Pod) {
	t.Helper()
	raw := p.Annotations["sidecar.istio.io/status"]
	var status struct {
		InitContainers []string `json:"initContainers"`
	}
	if err := json.Unmarshal([]byte(raw), &status); err != nil || !slices.Equal(status.InitContainers, []string{istio.ProxyContainer}) {
		t.Errorf("%s: sidecar.istio.io/status %q (%v): want initContainers [istio-proxy]", p.Name, raw, err)
	}
	var inits, ran []string
	for _, c := range p.Spec.InitContainers {
		inits = append(inits, c.Name)
		if c.Name == istio.ProxyContainer && (c.RestartPolicy == nil || *c.RestartPolicy != corev1.ContainerRestartPolicyAlways) {
			t.Errorf("%s: istio-proxy is not a native sidecar", p.Name)
		}
	}
	for _, s := range p.Status.InitContainerStatuses {
		ran = append(ran, s.Name)
	}
	if !slices.Equal(inits, []string{istio.ProxyContainer}) || !slices.Equal(ran, []string{istio.ProxyContainer}) {
		t.Errorf("%s: init containers %q, ran %q; want only the istio-proxy native sidecar", p.Name, inits, ran)
	}
	t.Logf("%s: init containers %q (sidecar.istio.io/status %s)", p.Name, inits, raw)
}

func countConn(recs []proxysim.Record, listener string, dst netip.AddrPort) int {
	n := 0
	for _, r := range recs {
		if conn(listener, dst)(r) {
			n++
		}
	}
	return n
}

// waitLabel waits until the agent's marker label of p has value want.
func waitLabel(ctx context.Context, t *testing.T, tb *testbed.Testbed, p *corev1.Pod, want string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for {
		got, err := tb.Client.CoreV1().Pods(p.Namespace).Get(ctx, p.Name, metav1.GetOptions{})
		if err == nil && got.Labels[agent.RedirectedLabel] == want {
			t.Logf("%s: %s=%s", p.Name, agent.RedirectedLabel, want)
			return
		}
		select {
		case <-ctx.Done():
			labels := fmt.Sprint(err)
			if got != nil {
				labels = fmt.Sprint(got.Labels)
			}
			t.Fatalf("%s: no %s=%s within 30s: labels %s", p.Name, agent.RedirectedLabel, want, labels)
		case <-time.After(200 * time.Millisecond):
		}
	}
}
