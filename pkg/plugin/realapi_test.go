package plugin_test

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/types"
	authv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/internal/testutil"
	"github.com/meshcni/meshcni/internal/traffic"
	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/engine"
	"github.com/meshcni/meshcni/pkg/podspec"
	"github.com/meshcni/meshcni/pkg/proxysim"
)

const e2eNamespace = "meshcni-plugin-e2e"

type podOpt func(*corev1.Pod)

// injectedPod is what Istio's sidecar injector stores (with istio-cni: no istio-init).
func injectedPod(ns, name string, opts ...podOpt) *corev1.Pod {
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: map[string]string{"app": name},
			Annotations: map[string]string{podspec.AnnotationStatus: `{"containers":["istio-proxy"],"initContainers":["istio-validation"]}`}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{
			{Name: "app", Image: "registry.example/app:1"},
			{Name: podspec.ProxyContainer, Image: "docker.io/istio/proxyv2:1.27.0", Args: []string{"proxy", "sidecar", "--domain", ns + ".svc.cluster.local"}},
		}},
	}
	for _, o := range opts {
		o(p)
	}
	return p
}

func withAnn(k, v string) podOpt { return func(p *corev1.Pod) { p.Annotations[k] = v } }
func withLabel(k, v string) podOpt {
	return func(p *corev1.Pod) { p.Labels[k] = v }
}
func withProxyEnv(k, v string) podOpt {
	return func(p *corev1.Pod) {
		c, _ := podspec.FindProxy(p)
		c.Env = append(c.Env, corev1.EnvVar{Name: k, Value: v})
	}
}
func withProxyArgs(a ...string) podOpt {
	return func(p *corev1.Pod) { c, _ := podspec.FindProxy(p); c.Args = a }
}
func withProxyUser(uid int64) podOpt {
	return func(p *corev1.Pod) {
		c, _ := podspec.FindProxy(p)
		c.SecurityContext = &corev1.SecurityContext{RunAsUser: &uid, RunAsGroup: &uid}
	}
}

var asNativeSidecar podOpt = func(p *corev1.Pod) {
	always := corev1.ContainerRestartPolicyAlways
	proxy := p.Spec.Containers[1]
	proxy.RestartPolicy = &always
	p.Spec.Containers = p.Spec.Containers[:1]
	p.Spec.InitContainers = append(p.Spec.InitContainers, proxy)
}

var withoutProxy podOpt = func(p *corev1.Pod) { p.Spec.Containers = p.Spec.Containers[:1] }

var withIstioInit podOpt = func(p *corev1.Pod) {
	p.Spec.InitContainers = append(p.Spec.InitContainers, corev1.Container{Name: "istio-init", Image: "docker.io/istio/proxyv2:1.27.0"})
}

// live returns meshcni's live rules in the netns, whatever the backend.
func live(t *testing.T, netns string) map[backend.Kind]string {
	t.Helper()
	l, err := engine.Live(context.Background(), engine.Options{Backend: backend.Auto, NetnsPath: netns})
	if err != nil {
		t.Fatalf("live rules: %v", err)
	}
	for k, v := range l {
		if strings.TrimSpace(v) == "" {
			delete(l, k)
		}
	}
	return l
}

// nftRuleset lists the whole nftables ruleset of a netns (iptables-nft included).
func nftRuleset(t *testing.T, netns string) string {
	t.Helper()
	nft, err := exec.LookPath("nft")
	if err != nil {
		return ""
	}
	out, err := traffic.RunInNetns(netns, traffic.Root, 10*time.Second, nft, "list", "ruleset")
	if err != nil {
		t.Fatalf("nft list ruleset: %v\n%s", err, out)
	}
	return strings.TrimSpace(string(out))
}

// TestRealAPIDecisionMatrix stores pods in a real API server, runs ADD through libcni
// for each in a fresh netns, and checks the netns: the meshed pods' rules equal the
// desired ones (engine.Check, no drift), the others have no rule at all. DEL then
// leaves nothing.
func TestRealAPIDecisionMatrix(t *testing.T) {
	tbd := testbedAPI(t)
	runDir := t.TempDir()
	kc := tbd.Kubeconfig()
	tests := []struct {
		name   string
		ns     string
		opts   []podOpt
		meshed bool
	}{
		{"sidecar", e2eNamespace, nil, true},
		{"native-sidecar", e2eNamespace, []podOpt{asNativeSidecar}, true},
		{"tproxy", e2eNamespace, []podOpt{withAnn(podspec.AnnotationInterceptionMode, "TPROXY")}, true},
		{"annotated", e2eNamespace, []podOpt{
			withAnn(podspec.AnnotationIncludeInboundPorts, "8080,9090"),
			withAnn(podspec.AnnotationExcludeOutboundPorts, "5432"),
			withAnn(podspec.AnnotationExcludeOutboundIPRanges, "169.254.169.254/32"),
			withAnn(podspec.AnnotationExcludeInterfaces, "net1"),
			withProxyEnv(podspec.EnvDNSCapture, "true"),
			withProxyUser(2000),
		}, true},
		{"inject-label-true-wins", e2eNamespace, []podOpt{withLabel(podspec.AnnotationInject, "true"), withAnn(podspec.AnnotationInject, "false")}, true},
		{"plain", e2eNamespace, []podOpt{withoutProxy}, false},
		{"no-status", e2eNamespace, []podOpt{func(p *corev1.Pod) { delete(p.Annotations, podspec.AnnotationStatus) }}, false},
		{"inject-label-false", e2eNamespace, []podOpt{withLabel(podspec.AnnotationInject, "false"), withAnn(podspec.AnnotationInject, "true")}, false},
		{"inject-annotation-false", e2eNamespace, []podOpt{withAnn(podspec.AnnotationInject, "false")}, false},
		{"istio-init", e2eNamespace, []podOpt{withIstioInit}, false},
		{"disable-envoy", e2eNamespace, []podOpt{withProxyEnv(podspec.EnvDisableEnvoy, "true")}, false},
		{"gateway", e2eNamespace, []podOpt{withProxyArgs("proxy", "router")}, false},
		{"agent", e2eNamespace, []podOpt{withLabel("app.kubernetes.io/name", "meshcni")}, false},
		{"excluded-ns", "kube-system", nil, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pod := createPod(t, injectedPod(tt.ns, tt.name, tt.opts...))
			netns := testutil.NewNetns(t)
			ch := newChain(t, []string{"10.250.0.2/24"}, meshcniEntry(runDir, kc, nil))
			rt := runtimeConf(netns, pod)
			res, err := ch.cfg.AddNetworkList(context.Background(), ch.list, rt)
			if err != nil {
				t.Fatalf("ADD: %v", err)
			}
			if !strings.Contains(fmt.Sprint(res), "10.250.0.2") {
				t.Fatalf("result %v lost the prevResult's IP", res)
			}
			if tt.meshed {
				s, err := podspec.Spec(pod)
				if err != nil {
					t.Fatal(err)
				}
				podspec.WithFamilies(s, []netip.Addr{netip.MustParseAddr("10.250.0.2")})
				d, err := engine.Check(context.Background(), engine.Options{Backend: backend.Auto, NetnsPath: netns}, s)
				if err != nil {
					t.Fatalf("engine.Check: %v", err)
				}
				if !d.Empty() {
					t.Fatalf("drift after ADD:\n%s", d)
				}
				if len(live(t, netns)) == 0 {
					t.Fatal("no live rules for a meshed pod")
				}
				if err := ch.cfg.CheckNetworkList(context.Background(), ch.list, rt); err != nil {
					t.Fatalf("CNI CHECK: %v", err)
				}
			} else {
				if l := live(t, netns); len(l) != 0 {
					t.Fatalf("rules in the netns of a pod that is not meshed: %v", l)
				}
				if r := nftRuleset(t, netns); r != "" {
					t.Fatalf("nft ruleset not empty:\n%s", r)
				}
			}
			if err := ch.cfg.DelNetworkList(context.Background(), ch.list, rt); err != nil {
				t.Fatalf("DEL: %v", err)
			}
			if l := live(t, netns); len(l) != 0 {
				t.Fatalf("rules left after DEL: %v", l)
			}
		})
	}
}

// TestRealAPIFailures: each failure mode against the real API server, with its error
// text, and no rule left in the netns.
func TestRealAPIFailures(t *testing.T) {
	tbd := testbedAPI(t)
	runDir := t.TempDir()
	ctx := context.Background()

	t.Run("bad annotation", func(t *testing.T) {
		pod := createPod(t, injectedPod(e2eNamespace, "bad-ann", withAnn(podspec.AnnotationExcludeOutboundIPRanges, "10.0.0.0/33")))
		netns := testutil.NewNetns(t)
		ch := newChain(t, []string{"10.250.0.2/24"}, meshcniEntry(runDir, tbd.Kubeconfig(), nil))
		_, err := ch.cfg.AddNetworkList(ctx, ch.list, runtimeConf(netns, pod))
		var e *types.Error
		if !errors.As(err, &e) || !strings.Contains(e.Msg, `traffic.sidecar.istio.io/excludeOutboundIPRanges "10.0.0.0/33"`) {
			t.Fatalf("ADD error %v", err)
		}
		if l := live(t, netns); len(l) != 0 {
			t.Fatalf("rules applied: %v", l)
		}
	})

	t.Run("pod not found", func(t *testing.T) {
		ensureNamespace(t, e2eNamespace)
		netns := testutil.NewNetns(t)
		ch := newChain(t, []string{"10.250.0.2/24"}, meshcniEntry(runDir, tbd.Kubeconfig(), map[string]any{"api_timeout": "1s"}))
		ghost := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: e2eNamespace, Name: "ghost", UID: "u-ghost"}}
		_, err := ch.cfg.AddNetworkList(ctx, ch.list, runtimeConf(netns, ghost))
		var e *types.Error
		if !errors.As(err, &e) || !strings.Contains(e.Msg, "pod "+e2eNamespace+"/ghost not found in the Kubernetes API at https://") ||
			!strings.Contains(e.Msg, "fails closed") {
			t.Fatalf("ADD error %v", err)
		}
	})

	t.Run("RBAC missing (403)", func(t *testing.T) {
		pod := createPod(t, injectedPod(e2eNamespace, "rbac"))
		kc := noRightsKubeconfig(t, tbd)
		netns := testutil.NewNetns(t)
		ch := newChain(t, []string{"10.250.0.2/24"}, meshcniEntry(runDir, kc, nil))
		_, err := ch.cfg.AddNetworkList(ctx, ch.list, runtimeConf(netns, pod))
		var e *types.Error
		if !errors.As(err, &e) || !strings.Contains(e.Msg, "403 Forbidden") || !strings.Contains(e.Msg, `cannot get resource \"pods\"`) && !strings.Contains(e.Msg, `cannot get resource "pods"`) ||
			!strings.Contains(e.Msg, "RBAC") {
			t.Fatalf("ADD error %v", err)
		}
		if l := live(t, netns); len(l) != 0 {
			t.Fatalf("rules applied: %v", l)
		}
	})

	t.Run("UID mismatch", func(t *testing.T) {
		pod := createPod(t, injectedPod(e2eNamespace, "recreated"))
		netns := testutil.NewNetns(t)
		ch := newChain(t, []string{"10.250.0.2/24"}, meshcniEntry(runDir, tbd.Kubeconfig(), nil))
		old := pod.DeepCopy()
		old.UID = "00000000-0000-0000-0000-000000000000"
		_, err := ch.cfg.AddNetworkList(ctx, ch.list, runtimeConf(netns, old))
		var e *types.Error
		if !errors.As(err, &e) || !strings.Contains(e.Msg, "the runtime is creating UID 00000000-0000-0000-0000-000000000000") {
			t.Fatalf("ADD error %v", err)
		}
	})

	t.Run("DEL with the API down and the netns gone", func(t *testing.T) {
		pod := createPod(t, injectedPod(e2eNamespace, "del"))
		netnsPath, err := testutil.CreateNetns(fmt.Sprintf("mcni-del-%d", os.Getpid()))
		if err != nil {
			t.Fatal(err)
		}
		ch := newChain(t, []string{"10.250.0.2/24"}, meshcniEntry(runDir, tbd.Kubeconfig(), nil))
		rt := runtimeConf(netnsPath, pod)
		if _, err := ch.cfg.AddNetworkList(ctx, ch.list, rt); err != nil {
			t.Fatal(err)
		}
		if err := testutil.DeleteNetns(netnsPath); err != nil {
			t.Fatal(err)
		}
		// A kubeconfig pointing nowhere: DEL must not need it.
		down := newChain(t, []string{"10.250.0.2/24"}, meshcniEntry(runDir, "/nonexistent/kubeconfig", nil))
		down.cfg = ch.cfg
		if err := ch.cfg.DelNetworkList(ctx, down.list, rt); err != nil {
			t.Fatalf("DEL: %v", err)
		}
	})
}

// noRightsKubeconfig writes a kubeconfig with the token of a fresh ServiceAccount that
// has no RBAC binding.
func noRightsKubeconfig(t *testing.T, tbd interface {
	Kubeconfig() string
}) string {
	t.Helper()
	c := testbedAPI(t).Client
	ctx := context.Background()
	ensureNamespace(t, e2eNamespace)
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "no-rights", Namespace: e2eNamespace}}
	if _, err := c.CoreV1().ServiceAccounts(e2eNamespace).Create(ctx, sa, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	exp := int64(600)
	tr, err := c.CoreV1().ServiceAccounts(e2eNamespace).CreateToken(ctx, "no-rights", &authv1.TokenRequest{Spec: authv1.TokenRequestSpec{ExpirationSeconds: &exp}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("token request: %v", err)
	}
	rc := testbedAPI(t).RESTConfig
	ca := rc.CAData
	if len(ca) == 0 {
		if ca, err = os.ReadFile(rc.CAFile); err != nil {
			t.Fatal(err)
		}
	}
	doc := fmt.Sprintf("apiVersion: v1\nkind: Config\ncurrent-context: x\nclusters: [{name: c, cluster: {server: %q, certificate-authority-data: %s}}]\nusers: [{name: u, user: {token: %q}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\n",
		rc.Host, base64.StdEncoding.EncodeToString(ca), tr.Status.Token)
	path := filepath.Join(t.TempDir(), "no-rights.kubeconfig")
	if err := os.WriteFile(path, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestTrafficThroughPlugin: a meshed pod (stored in the real API server) gets its
// redirect from the plugin run through libcni; its outbound and inbound TCP reach the
// stand-in proxy, running as UID 1337, with the original destination intact.
func TestTrafficThroughPlugin(t *testing.T) {
	tbd := testbedAPI(t)
	pod := traffic.NewPod(t)
	k8sPod := createPod(t, injectedPod(e2eNamespace, "traffic"))
	proxy := traffic.StartProxy(t, pod.NetNS, traffic.ProxyOptions{})
	ch := newChain(t, []string{pod.IPv4.String() + "/24", pod.IPv6.String() + "/64"}, meshcniEntry(t.TempDir(), tbd.Kubeconfig(), nil))
	rt := runtimeConf(pod.NetNS, k8sPod)
	if _, err := ch.cfg.AddNetworkList(context.Background(), ch.list, rt); err != nil {
		t.Fatalf("ADD: %v", err)
	}
	app := traffic.Cred{UID: 1000, GID: 1000}
	for _, f := range []struct {
		name      string
		pod, peer netip.Addr
	}{{"ipv4", pod.IPv4, pod.PeerIPv4}, {"ipv6", pod.IPv6, pod.PeerIPv6}} {
		t.Run(f.name+" outbound", func(t *testing.T) {
			dst := netip.AddrPortFrom(f.peer, 8080)
			a := traffic.Dial(t, pod.NetNS, dst, traffic.DialOptions{Cred: app})
			if a.Listener() != proxysim.ListenerOutbound || a.OrigDst() != dst {
				t.Fatalf("want the outbound listener with original destination %v, got %+v (proxy %+v)", dst, a.ProbeResult, a.Proxy)
			}
			if a.Proxy.UID != traffic.ProxyUID {
				t.Fatalf("proxy ran as uid %d", a.Proxy.UID)
			}
		})
		t.Run(f.name+" inbound", func(t *testing.T) {
			dst := netip.AddrPortFrom(f.pod, 9090)
			a := traffic.Dial(t, pod.PeerNetNS, dst, traffic.DialOptions{Cred: app})
			if a.Listener() != proxysim.ListenerInbound || a.OrigDst() != dst {
				t.Fatalf("want the inbound listener with original destination %v, got %+v (proxy %+v)", dst, a.ProbeResult, a.Proxy)
			}
		})
	}
	if len(proxy.Records()) == 0 {
		t.Fatal("the proxy recorded nothing")
	}
	if err := ch.cfg.DelNetworkList(context.Background(), ch.list, rt); err != nil {
		t.Fatalf("DEL: %v", err)
	}
	// After DEL the redirect is gone: outbound no longer lands on the proxy.
	a := traffic.Dial(t, pod.NetNS, netip.AddrPortFrom(pod.PeerIPv4, 8080), traffic.DialOptions{Cred: app, Timeout: time.Second})
	if a.Proxy != nil {
		t.Fatalf("still redirected after DEL: %+v", a.Proxy)
	}
}

// BenchmarkChain measures CNI ADD and DEL of the chain through libcni, against the
// real API server: without meshcni; with meshcni for a pod that is not meshed and for
// a meshed pod (default backend, and iptables-nft); each without an agent (the pod
// GET goes to the API server, DEL closes its own netlink sockets) and with the real
// agent socket answering from a real informer cache of the pod's node (-agent).
// Reported per variant: mean, p50 and p99 of ADD and DEL in ms. Run with
// -benchtime=100x (the issue's ≥ 100 pods).
//
// MESHCNI_BENCH_BEFORE=/path/to/an/older/meshcni adds the same variants run with
// that binary (before-*), side by side in the same run.
func BenchmarkChain(b *testing.B) {
	tbd := testbedAPI(b)
	node := fakeNode()
	cache := nodeCache(b, tbd, node)
	agentDir := startAgentSocket(b, cache)
	noAgentDir := b.TempDir()
	plainUnscheduled := createPod(b, injectedPod(e2eNamespace, "bench-plain", withoutProxy))
	kc := tbd.Kubeconfig()
	entry := func(runDir string, extra map[string]any) map[string]any {
		m := map[string]any{"plugin_log_level": "warn"}
		for k, v := range extra {
			m[k] = v
		}
		return meshcniEntry(runDir, kc, m)
	}
	type variant struct {
		name  string
		bin   string
		pod   func(b *testing.B) *corev1.Pod
		entry map[string]any
	}
	// cachedPod stores a fresh pod on the agent's node for one variant (a pod bound to
	// a node that does not exist is collected after 40 s: keep each one short-lived).
	cachedPod := func(opts ...podOpt) func(b *testing.B) *corev1.Pod {
		return func(b *testing.B) *corev1.Pod {
			p := nodePod(b, node, injectedPod(e2eNamespace, "bench", opts...))
			waitCached(b, cache, p)
			return p
		}
	}
	plain := func(*testing.B) *corev1.Pod { return plainUnscheduled }
	variants := func(prefix, bin string) []variant {
		return []variant{
			{prefix + "meshcni-not-meshed", bin, plain, entry(noAgentDir, nil)},
			{prefix + "meshcni-not-meshed-agent", bin, cachedPod(withoutProxy), entry(agentDir, nil)},
			{prefix + "meshcni-meshed", bin, cachedPod(), entry(noAgentDir, nil)},
			{prefix + "meshcni-meshed-agent", bin, cachedPod(), entry(agentDir, nil)},
			{prefix + "meshcni-meshed-iptables-nft", bin, cachedPod(), entry(noAgentDir, map[string]any{"backend": "iptables-nft"})},
			{prefix + "meshcni-meshed-iptables-nft-agent", bin, cachedPod(), entry(agentDir, map[string]any{"backend": "iptables-nft"})},
		}
	}
	all := []variant{{"without-meshcni", binaries(b), cachedPod(), nil}}
	all = append(all, variants("", binaries(b))...)
	if before := os.Getenv("MESHCNI_BENCH_BEFORE"); before != "" {
		dir := b.TempDir()
		for name, src := range map[string]string{"meshcni": before, "prevplugin": filepath.Join(binaries(b), "prevplugin")} {
			data, err := os.ReadFile(src)
			if err != nil {
				b.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(dir, name), data, 0o755); err != nil {
				b.Fatal(err)
			}
		}
		all = append(all, variants("before-", dir)...)
	}
	for _, v := range all {
		b.Run(v.name, func(b *testing.B) {
			pod := v.pod(b)
			netns := testutil.NewNetns(b)
			ch := newChainIn(b, v.bin, []string{"10.250.0.2/24"}, v.entry)
			rt := runtimeConf(netns, pod)
			ctx := context.Background()
			add := make([]time.Duration, 0, b.N)
			del := make([]time.Duration, 0, b.N)
			b.ResetTimer()
			for range b.N {
				t0 := time.Now()
				if _, err := ch.cfg.AddNetworkList(ctx, ch.list, rt); err != nil {
					b.Fatalf("ADD: %v", err)
				}
				t1 := time.Now()
				if err := ch.cfg.DelNetworkList(ctx, ch.list, rt); err != nil {
					b.Fatalf("DEL: %v", err)
				}
				add = append(add, t1.Sub(t0))
				del = append(del, time.Since(t1))
			}
			b.StopTimer()
			for _, m := range []struct {
				name string
				d    []time.Duration
			}{{"add", add}, {"del", del}} {
				mean, p50, p99 := latencies(m.d)
				b.ReportMetric(mean, m.name+"-ms")
				b.ReportMetric(p50, m.name+"-p50-ms")
				b.ReportMetric(p99, m.name+"-p99-ms")
			}
		})
	}
}

// latencies returns the mean, median and 99th percentile of ds in milliseconds.
func latencies(ds []time.Duration) (mean, p50, p99 float64) {
	if len(ds) == 0 {
		return 0, 0, 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	var sum time.Duration
	for _, d := range s {
		sum += d
	}
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	i99 := (len(s)*99+99)/100 - 1
	return ms(sum / time.Duration(len(s))), ms(s[len(s)/2]), ms(s[i99])
}

// BenchmarkColdStart execs the plugin binary (CNI VERSION): process start-up cost.
func BenchmarkColdStart(b *testing.B) {
	bin := filepath.Join(binaries(b), "meshcni")
	for range b.N {
		cmd := exec.Command(bin)
		cmd.Env = []string{"CNI_COMMAND=VERSION"}
		cmd.Stdin = strings.NewReader(`{"cniVersion":"1.1.0"}`)
		if out, err := cmd.CombinedOutput(); err != nil {
			b.Fatalf("%v: %s", err, out)
		}
	}
}
