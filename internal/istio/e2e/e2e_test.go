package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/meshcni/meshcni/internal/istio"
	"github.com/meshcni/meshcni/internal/proxysim"
	"github.com/meshcni/meshcni/internal/testbed"
	"github.com/meshcni/meshcni/internal/testutil"
)

func TestMain(m *testing.M) { os.Exit(testbed.RunMain(m)) }

const (
	namespace  = "istio-e2e"
	serverPort = 8080 // the echo server's
	appUID     = 1000
)

// deployment is one app Deployment in namespace: the app image serving TCP on
// serverPort as appUID (the client serves too, to stay up; probes are exec'd).
func deployment(name string) *appsv1.Deployment {
	one := int32(1)
	uid := int64(appUID)
	labels := map[string]string{"app": name}
	return &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace},
		Spec: appsv1.DeploymentSpec{
			Replicas: &one,
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec: corev1.PodSpec{
					TerminationGracePeriodSeconds: new(int64),
					Containers: []corev1.Container{{
						Name: "app", Image: istio.AppImage, ImagePullPolicy: corev1.PullNever,
						Args:            []string{"serve"},
						Env:             []corev1.EnvVar{{Name: "PORT", Value: strconv.Itoa(serverPort)}},
						Ports:           []corev1.ContainerPort{{ContainerPort: serverPort}},
						SecurityContext: &corev1.SecurityContext{RunAsUser: &uid, RunAsGroup: &uid},
					}},
				},
			},
		},
	}
}

// TestRealIstio: the real webhook injects a client and a server Deployment, Istio's
// istio-validation passes on meshcni's rules, the pods go Ready through
// pilot-agent's 15021, and client → server TCP is captured on 15001 with its
// original destination and arrives at the server's proxy on 15006.
func TestRealIstio(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "go")
	testutil.RequireBinary(t, "ctr")
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	if _, err := istio.Lookup(ctx); err != nil {
		testutil.Missing(t, "%v", err)
	}
	root, err := testbed.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	tb := testbed.Shared(t)
	began := time.Now()
	inst, err := istio.Up(ctx, tb, istio.Options{RepoRoot: root})
	if inst != nil {
		for _, s := range inst.Steps {
			t.Logf("%8s  %s", s.Took.Round(time.Millisecond), s.Name)
		}
	}
	t.Cleanup(func() {
		if err := istio.Down(context.Background(), tb, istio.Options{RepoRoot: root}); err != nil {
			t.Errorf("istio down: %v", err)
		}
	})
	if err != nil {
		t.Fatalf("istio up: %v", err)
	}
	t.Logf("istio %s (%s) and meshcni up in %s", inst.Build.Version, inst.Build.Release, time.Since(began).Round(time.Millisecond))

	if err := tb.CreateNamespace(ctx, namespace); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { deleteNamespace(t, tb) })
	label := []byte(`{"metadata":{"labels":{"istio-injection":"enabled"}}}`)
	if _, err := tb.Client.CoreV1().Namespaces().Patch(ctx, namespace, types.StrategicMergePatchType, label, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	created := time.Now()
	pods := map[string]*corev1.Pod{}
	for _, name := range []string{"server", "client"} {
		if _, err := tb.Client.AppsV1().Deployments(namespace).Create(ctx, deployment(name), metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	for _, name := range []string{"server", "client"} {
		p, err := readyPod(ctx, tb, name)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		t.Logf("%s: pod %s Ready %s after the Deployments were created", name, p.Name, time.Since(created).Round(time.Millisecond))
		pods[name] = p
		checkInjected(t, p)
		checkProxyLog(ctx, t, tb, p)
	}
	checkTraffic(ctx, t, tb, pods["client"], pods["server"])
}

// readyPod waits for the Deployment's pod and for it to be Ready.
func readyPod(ctx context.Context, tb *testbed.Testbed, app string) (*corev1.Pod, error) {
	wctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	for {
		l, err := tb.Client.CoreV1().Pods(namespace).List(wctx, metav1.ListOptions{LabelSelector: "app=" + app})
		if err == nil && len(l.Items) == 1 {
			return tb.WaitPodReady(wctx, namespace, l.Items[0].Name)
		}
		select {
		case <-wctx.Done():
			return nil, fmt.Errorf("no pod of Deployment %s: %w", app, wctx.Err())
		case <-time.After(200 * time.Millisecond):
		}
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

// proxyRecords are the stand-in's records in the istio-proxy container's log
// (pilot-agent passes Envoy's stdout through).
func proxyRecords(logs string) []proxysim.Record {
	var out []proxysim.Record
	for _, line := range strings.Split(logs, "\n") {
		if !strings.HasPrefix(line, `{"event":`) {
			continue
		}
		var r proxysim.Record
		if json.Unmarshal([]byte(line), &r) == nil {
			out = append(out, r)
		}
	}
	return out
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
	logs, err := tb.PodLogs(ctx, namespace, p.Name, "istio-proxy")
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
	spiffe := "spiffe://cluster.local/ns/" + namespace + "/sa/default"
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
func checkTraffic(ctx context.Context, t *testing.T, tb *testbed.Testbed, client, server *corev1.Pod) {
	t.Helper()
	dst := netip.AddrPortFrom(netip.MustParseAddr(server.Status.PodIP), serverPort)
	clientIP := netip.MustParseAddr(client.Status.PodIP)
	stdout, stderr, err := tb.Exec(ctx, namespace, client.Name, "app", "/proxysim", "client", "--connect", dst.String(), "--send", "hello\n")
	if err != nil {
		t.Fatalf("probe from %s: %v: %s", client.Name, err, stderr)
	}
	var res proxysim.ProbeResult
	if err := json.Unmarshal([]byte(stdout), &res); err != nil {
		t.Fatalf("probe result %q: %v", stdout, err)
	}
	t.Logf("probe %s → %v: %+v", client.Name, dst, res)
	if !res.Connected || res.Error != "" || res.UID != appUID {
		t.Fatalf("probe %+v", res)
	}
	if !strings.Contains(res.Reply, "127.0.0.6:") || !strings.HasSuffix(res.Reply, "hello\n") {
		t.Errorf("reply %q: want the server app to see Istio's inbound passthrough source 127.0.0.6 and echo hello", res.Reply)
	}
	out, err := waitRecord(ctx, tb, client.Name, func(r proxysim.Record) bool {
		return r.Event == proxysim.EventConn && r.Listener == proxysim.ListenerOutbound && r.OrigDst == dst
	})
	if err != nil {
		t.Fatalf("client proxy: %v", err)
	}
	if out.Local.Port() != 15001 || out.ForwardErr != "" || out.UID != istio.ProxyUID {
		t.Errorf("client proxy record %+v: want accepted on 15001, forwarded, as UID %d", out, istio.ProxyUID)
	}
	in, err := waitRecord(ctx, tb, server.Name, func(r proxysim.Record) bool {
		return r.Event == proxysim.EventConn && r.Listener == proxysim.ListenerInbound && r.OrigDst == dst && r.Peer.Addr() == clientIP
	})
	if err != nil {
		t.Fatalf("server proxy: %v", err)
	}
	if in.Local.Port() != 15006 || in.ForwardErr != "" {
		t.Errorf("server proxy record %+v: want accepted on 15006 and forwarded", in)
	}
	t.Logf("outbound %v → %v captured on %v; inbound from %v captured on %v", out.Peer, out.OrigDst, out.Local, in.Peer, in.Local)
}

// waitRecord polls a pod's istio-proxy log for a record matching match.
func waitRecord(ctx context.Context, tb *testbed.Testbed, pod string, match func(proxysim.Record) bool) (proxysim.Record, error) {
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	var logs string
	for {
		var err error
		logs, err = tb.PodLogs(ctx, namespace, pod, "istio-proxy")
		if err == nil {
			for _, r := range proxyRecords(logs) {
				if match(r) {
					return r, nil
				}
			}
		}
		select {
		case <-ctx.Done():
			return proxysim.Record{}, errors.New("no matching record in the istio-proxy log:\n" + logs)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func deleteNamespace(t *testing.T, tb *testbed.Testbed) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := tb.Client.CoreV1().Namespaces().Delete(ctx, namespace, metav1.DeleteOptions{}); err != nil {
		t.Errorf("delete namespace %s: %v", namespace, err)
		return
	}
	for {
		if _, err := tb.Client.CoreV1().Namespaces().Get(ctx, namespace, metav1.GetOptions{}); err != nil {
			return
		}
		select {
		case <-ctx.Done():
			t.Errorf("namespace %s not gone", namespace)
			return
		case <-time.After(250 * time.Millisecond):
		}
	}
}
