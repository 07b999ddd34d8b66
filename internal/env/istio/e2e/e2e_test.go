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

	"github.com/meshcni/meshcni/internal/env/istio"
	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/standin/proxysim"
)

const namespace = "istio-e2e"

// TestRealIstio: the real webhook injects a client and a server Deployment, Istio's
// istio-validation passes on meshcni's rules, the pods go Ready through
// pilot-agent's 15021, and client → server TCP is captured on 15001 with its
// original destination and arrives at the server's proxy on 15006. meshcnictl takes
// the injected istio-validation arguments unchanged (checkDropIn).
func TestRealIstio(t *testing.T) {
	tb := upParallel(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()

	t.Cleanup(func() {
		if err := istio.DeleteNamespace(context.Background(), tb, namespace); err != nil {
			t.Error(err)
		}
	})
	app, err := istio.StartApp(ctx, tb, namespace)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("pods %s and %s Ready %s after the Deployments were created", app.Server.Name, app.Client.Name, app.Ready.Round(time.Millisecond))
	for _, p := range []*corev1.Pod{app.Server, app.Client} {
		checkInjected(t, p)
		checkProxyLog(ctx, t, tb, p)
	}
	checkTraffic(ctx, t, tb, app)
	if v := container(app.Server, "istio-validation"); v != nil {
		checkDropIn(t, v.Args)
	}
}

// allContainers lists init (native sidecars included) and app containers.
func allContainers(p *corev1.Pod) []corev1.Container {
	return append(append([]corev1.Container{}, p.Spec.InitContainers...), p.Spec.Containers...)
}

func container(p *corev1.Pod, name string) *corev1.Container {
	for _, c := range allContainers(p) {
		if c.Name == name {
			return &c
		}
	}
	return nil
}

// checkInjected asserts what only istiod's injector in CNI mode writes.
func checkInjected(t *testing.T, p *corev1.Pod) {
	t.Helper()
	var status struct {
		InitContainers []string `json:"initContainers"`
		Containers     []string `json:"containers"`
		Revision       string   `json:"revision"`
	}
	raw, ok := p.Annotations["sidecar.istio.io/status"]
	if !ok {
		t.Fatalf("%s: no sidecar.istio.io/status annotation: the webhook did not inject it", p.Name)
	}
	if err := json.Unmarshal([]byte(raw), &status); err != nil {
		t.Fatalf("%s: sidecar.istio.io/status %q: %v", p.Name, raw, err)
	}
	// istio-proxy is a native sidecar (an init container) on this Kubernetes.
	if !slices.Contains(status.InitContainers, "istio-validation") || !slices.Contains(append(status.InitContainers, status.Containers...), "istio-proxy") {
		t.Errorf("%s: sidecar.istio.io/status %s: want istio-validation and istio-proxy", p.Name, raw)
	}
	if slices.Contains(status.InitContainers, "istio-init") {
		t.Errorf("%s: injected istio-init (not CNI mode): %s", p.Name, raw)
	}
	v := container(p, "istio-validation")
	if v == nil {
		t.Fatalf("%s: no istio-validation init container", p.Name)
	}
	if v.Image != istio.ProxyImage || !slices.Contains(v.Args, "istio-iptables") || !slices.Contains(v.Args, "--run-validation") || !slices.Contains(v.Args, "--skip-rule-apply") {
		t.Errorf("%s: istio-validation runs %s %q; want Istio's pilot-agent image %s with istio-iptables --run-validation --skip-rule-apply", p.Name, v.Image, v.Args, istio.ProxyImage)
	}
	t.Logf("%s: istio-validation args %q", p.Name, v.Args)
	for _, c := range allContainers(p) {
		sc := c.SecurityContext
		if sc == nil || sc.Capabilities == nil {
			continue
		}
		for _, cap := range sc.Capabilities.Add {
			if cap == "NET_ADMIN" || cap == "NET_RAW" {
				t.Errorf("%s/%s adds %s", p.Name, c.Name, cap)
			}
		}
	}
	exit := int32(-1)
	for _, s := range p.Status.InitContainerStatuses {
		if s.Name == "istio-validation" && s.State.Terminated != nil {
			exit = s.State.Terminated.ExitCode
		}
	}
	if exit != 0 {
		t.Errorf("%s: istio-validation exit code %d, want 0", p.Name, exit)
	}
	px := container(p, "istio-proxy")
	if px == nil || px.Image != istio.ProxyImage {
		t.Fatalf("%s: no istio-proxy container running %s", p.Name, istio.ProxyImage)
	}
	rp := px.ReadinessProbe
	if rp == nil || rp.HTTPGet == nil || rp.HTTPGet.Port.IntValue() != 15021 || rp.HTTPGet.Path != "/healthz/ready" {
		t.Errorf("%s: istio-proxy readiness probe %+v, want GET :15021/healthz/ready", p.Name, rp)
	}
}

// logLine is one JSON log line of the stand-in (slog: msg plus attributes).
type logLine map[string]any

// standInLog returns the stand-in's JSON log lines with the given msg.
func standInLog(logs, msg string) []logLine {
	var out []logLine
	for _, line := range strings.Split(logs, "\n") {
		var l logLine
		if !strings.HasPrefix(line, `{"time":`) || json.Unmarshal([]byte(line), &l) != nil {
			continue
		}
		if l["msg"] == msg {
			out = append(out, l)
		}
	}
	return out
}

// checkProxyLog asserts that pilot-agent started the stand-in as Envoy, that it
// accepted clusters and listeners from istiod over ADS, went LIVE as UID 1337, and
// received the workload certificate istiod signed for the pod's service account.
func checkProxyLog(ctx context.Context, t *testing.T, tb *testbed.Testbed, p *corev1.Pod) {
	t.Helper()
	logs, err := tb.PodLogs(ctx, p.Namespace, p.Name, "istio-proxy")
	if err != nil {
		t.Fatal(err)
	}
	has := func(msg, key string, want any) bool {
		for _, l := range standInLog(logs, msg) {
			if key == "" || fmt.Sprint(l[key]) == fmt.Sprint(want) {
				return true
			}
		}
		return false
	}
	spiffe := "spiffe://cluster.local/ns/" + p.Namespace + "/sa/default"
	for _, c := range []struct {
		msg, key string
		want     any
	}{
		{"envoy stand-in started", "", nil},
		{"xds update accepted", "type", proxysim.TypeCluster},
		{"xds update accepted", "type", proxysim.TypeListener},
		{"envoy stand-in LIVE", "uid", istio.ProxyUID},
		{"sds secret accepted", "uris", []any{spiffe}},
	} {
		if !has(c.msg, c.key, c.want) {
			t.Errorf("%s: istio-proxy log has no %q with %s=%v:\n%s", p.Name, c.msg, c.key, c.want, logs)
		}
	}
	if len(standInLog(logs, "xds update rejected"))+len(standInLog(logs, "sds update rejected")) > 0 {
		t.Errorf("%s: the stand-in rejected an update:\n%s", p.Name, logs)
	}
}

// checkTraffic: a probe from the client's app container to the server's pod IP is
// captured by the client's proxy on 15001 with the original destination intact,
// forwarded, captured again by the server's proxy on 15006, and delivered to the
// server app from Istio's inbound passthrough source 127.0.0.6.
func checkTraffic(ctx context.Context, t *testing.T, tb *testbed.Testbed, app *istio.App) {
	t.Helper()
	tr, err := app.Probe(ctx, tb)
	if err != nil {
		t.Fatal(err)
	}
	res := tr.Probe
	t.Logf("probe %s → %v: %+v", app.Client.Name, tr.Dst, res)
	if !res.Connected || res.Error != "" || res.UID != istio.AppUID {
		t.Fatalf("probe %+v", res)
	}
	if !strings.Contains(res.Reply, "127.0.0.6:") || !strings.HasSuffix(res.Reply, "hello\n") {
		t.Errorf("reply %q: want the server app to see Istio's inbound passthrough source 127.0.0.6 and echo hello", res.Reply)
	}
	out, in := tr.Outbound, tr.Inbound
	if out.Local.Port() != 15001 || out.ForwardErr != "" || out.UID != istio.ProxyUID {
		t.Errorf("client proxy record %+v: want accepted on 15001, forwarded, as UID %d", out, istio.ProxyUID)
	}
	if in.Local.Port() != 15006 || in.ForwardErr != "" || in.OrigDst != tr.Dst {
		t.Errorf("server proxy record %+v: want accepted on 15006 with original destination %v, forwarded", in, tr.Dst)
	}
	t.Logf("outbound %v → %v captured on %v; inbound from %v captured on %v", out.Peer, out.OrigDst, out.Local, in.Peer, in.Local)
}
