package plugin_test

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/types"
	authv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/internal/standin/proxysim"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/internal/testkit/traffic"
	"github.com/meshcni/meshcni/pkg/agent/nodepods"
	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/engine"
	"github.com/meshcni/meshcni/pkg/spec"
)

const e2eNamespace = "meshcni-plugin-e2e"

type podOpt func(*corev1.Pod)

// injectedPod is what Istio's sidecar injector stores (with istio-cni: no istio-init).
func injectedPod(ns, name string, opts ...podOpt) *corev1.Pod {
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: map[string]string{"app": name},
			Annotations: map[string]string{capture.AnnotationStatus: `{"containers":["istio-proxy"],"initContainers":["istio-validation"]}`}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{
			{Name: "app", Image: "registry.example/app:1"},
			{Name: capture.ProxyContainer, Image: "docker.io/istio/proxyv2:1.27.0", Args: []string{"proxy", "sidecar", "--domain", ns + ".svc.cluster.local"}},
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
		c, _ := proxyContainer(p)
		c.Env = append(c.Env, corev1.EnvVar{Name: k, Value: v})
	}
}
func withProxyArgs(a ...string) podOpt {
	return func(p *corev1.Pod) { c, _ := proxyContainer(p); c.Args = a }
}
func withProxyUser(uid int64) podOpt {
	return func(p *corev1.Pod) {
		c, _ := proxyContainer(p)
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
	nft := testutil.RequireBinary(t, "nft")
	out, err := traffic.RunInNetns(netns, traffic.Root, 10*time.Second, nft, "list", "ruleset")
	if err != nil {
		t.Fatalf("nft list ruleset: %v\n%s", err, out)
	}
	return strings.TrimSpace(string(out))
}

// istioSidecarSpec is the redirect of an injected pod without traffic annotations on
// an IPv4 pod, as istio-cni programs it (istio-iptables -p 15001 -z 15006 -e 15008
// -u 1337 -g 1337 -m REDIRECT -i '*' -x "" -b '*' -d 15020,15021,15090 -o 15020),
// written out field by field.
func istioSidecarSpec() spec.Spec {
	return spec.Spec{
		ProxyPort:            15001,
		InboundCapturePort:   15006,
		InboundTunnelPort:    15008,
		DNSPort:              15053,
		ProxyUIDs:            []uint32{1337},
		ProxyGIDs:            []uint32{1337},
		Mode:                 spec.ModeRedirect,
		InboundPorts:         spec.PortSet{All: true},
		InboundPortsExclude:  []uint16{15020, 15021, 15090},
		OutboundIPRanges:     spec.PrefixSet{All: true},
		OutboundPortsExclude: []uint16{15020},
		TProxyMark:           1337,
		TProxyRouteTable:     133,
		EnableIPv4:           true,
		IPv6:                 spec.IPv6Istio,
		HostLoopback:         netip.MustParsePrefix("127.0.0.1/32"),
	}
}

// TestRealAPIDecisionMatrix stores pods in a real API server, runs ADD through libcni
// for each in a fresh netns, and checks the netns: the meshed pods' rules equal the
// spec written out in the table (engine.Check, no drift), the others have no rule at all. DEL then
// leaves nothing.
func TestRealAPIDecisionMatrix(t *testing.T) {
	tbd := testbedAPI(t)
	runDir := t.TempDir()
	kc := tbd.Kubeconfig()
	// want is the redirect Istio's sidecar injection gives the pod, written out here
	// (nil: not meshed, no rule at all), independently of pkg/capture.
	annotated := istioSidecarSpec()
	annotated.InboundPorts = spec.PortSet{Ports: []uint16{8080, 9090}}
	annotated.OutboundPortsExclude = []uint16{5432} // the annotation replaces the default 15020
	annotated.OutboundIPRangesExclude = []netip.Prefix{netip.MustParsePrefix("169.254.169.254/32")}
	annotated.ExcludeInterfaces = []string{"net1"}
	annotated.RedirectDNS, annotated.CaptureAllDNS = true, true
	annotated.ProxyUIDs, annotated.ProxyGIDs = []uint32{2000}, []uint32{2000}
	tproxy := istioSidecarSpec()
	tproxy.Mode = spec.ModeTProxy
	sidecar := istioSidecarSpec()
	tests := []struct {
		name string
		ns   string
		opts []podOpt
		want *spec.Spec
	}{
		{"sidecar", e2eNamespace, nil, &sidecar},
		{"native-sidecar", e2eNamespace, []podOpt{asNativeSidecar}, &sidecar},
		{"tproxy", e2eNamespace, []podOpt{withAnn(capture.AnnotationInterceptionMode, "TPROXY")}, &tproxy},
		{"annotated", e2eNamespace, []podOpt{
			withAnn(capture.AnnotationIncludeInboundPorts, "8080,9090"),
			withAnn(capture.AnnotationExcludeOutboundPorts, "5432"),
			withAnn(capture.AnnotationExcludeOutboundIPRanges, "169.254.169.254/32"),
			withAnn(capture.AnnotationExcludeInterfaces, "net1"),
			withProxyEnv(capture.EnvDNSCapture, "true"),
			withProxyUser(2000),
		}, &annotated},
		{"inject-label-true-wins", e2eNamespace, []podOpt{withLabel(capture.AnnotationInject, "true"), withAnn(capture.AnnotationInject, "false")}, &sidecar},
		{"plain", e2eNamespace, []podOpt{withoutProxy}, nil},
		{"no-status", e2eNamespace, []podOpt{func(p *corev1.Pod) { delete(p.Annotations, capture.AnnotationStatus) }}, nil},
		{"inject-label-false", e2eNamespace, []podOpt{withLabel(capture.AnnotationInject, "false"), withAnn(capture.AnnotationInject, "true")}, nil},
		{"inject-annotation-false", e2eNamespace, []podOpt{withAnn(capture.AnnotationInject, "false")}, nil},
		{"istio-init", e2eNamespace, []podOpt{withIstioInit}, nil},
		{"disable-envoy", e2eNamespace, []podOpt{withProxyEnv(capture.EnvDisableEnvoy, "true")}, nil},
		{"gateway", e2eNamespace, []podOpt{withProxyArgs("proxy", "router")}, nil},
		{"agent", e2eNamespace, []podOpt{withLabel("app.kubernetes.io/name", "meshcni")}, nil},
		// The agent's label outside the agent's namespace is no opt-out.
		{"agent-label-elsewhere", "default", []podOpt{withLabel("app.kubernetes.io/name", "meshcni")}, &sidecar},
		{"excluded-ns", "kube-system", nil, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pod := createPod(t, injectedPod(tt.ns, tt.name, tt.opts...))
			netns := testutil.NewNetns(t)
			// As the agent writes it: its own namespace (here, the test's) exempts its pods.
			ch := newChain(t, []string{"10.250.0.2/24"}, meshcniEntry(runDir, kc, map[string]any{"agent_pod_namespace": e2eNamespace}))
			rt := runtimeConf(netns, pod)
			res, err := ch.cfg.AddNetworkList(context.Background(), ch.list, rt)
			if err != nil {
				t.Fatalf("ADD: %v", err)
			}
			if !strings.Contains(fmt.Sprint(res), "10.250.0.2") {
				t.Fatalf("result %v lost the prevResult's IP", res)
			}
			if tt.want != nil {
				d, err := engine.Check(context.Background(), engine.Options{Backend: backend.Auto, NetnsPath: netns}, tt.want)
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
		pod := createPod(t, injectedPod(e2eNamespace, "bad-ann", withAnn(capture.AnnotationExcludeOutboundIPRanges, "10.0.0.0/33")))
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

// TestTrafficThroughPlugin: a meshed dual-stack pod (stored in the real API server; its
// proxy has ISTIO_DUAL_STACK=true, so Istio captures IPv6 too) gets its redirect from
// the plugin run through libcni; its outbound and inbound TCP of both families reach
// the stand-in proxy, running as UID 1337, with the original destination intact.
func TestTrafficThroughPlugin(t *testing.T) {
	tbd := testbedAPI(t)
	pod := traffic.NewPod(t)
	k8sPod := createPod(t, injectedPod(e2eNamespace, "traffic", withProxyEnv(capture.EnvDualStack, "true")))
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
	// After DEL the redirect is gone: outbound reaches the peer's own server directly
	// (a failed connection proves nothing, so it fails the test too).
	peer := netip.AddrPortFrom(pod.PeerIPv4, 8080)
	traffic.StartApp(t, pod.PeerNetNS, netip.MustParseAddrPort("[::]:8080"), "peer-app")
	a := traffic.Dial(t, pod.NetNS, peer, traffic.DialOptions{Cred: app, Timeout: time.Second})
	if a.Proxy != nil {
		t.Fatalf("still redirected after DEL: %+v", a.Proxy)
	}
	if a.App == nil || a.App.Server != "peer-app" || a.App.Local != peer {
		t.Fatalf("after DEL, want the peer's server reached directly at %v, got %+v (app %+v)", peer, a.ProbeResult, a.App)
	}
}

// BenchmarkChain measures CNI ADD and DEL of the chain through libcni, against the
// real API server, for these variants: without meshcni; with meshcni for a pod that
// is not meshed and for a meshed pod (default backend, and iptables-nft), each
// without an agent (the pod GET goes to the API server, DEL closes its own netlink
// sockets) and with the real agent socket answering from a real informer cache of the
// pod's node (-agent). Set MESHCNI_BENCH_BEFORE=/path/to/an/older/meshcni to add the
// same variants run with that binary (before-*).
//
// The machine is shared and noisy, so the variants are interleaved: each of the b.N
// rounds runs every variant once (in a rotating order), each in a fresh network
// namespace as a real pod would be (namespace creation is not timed). A table of
// mean, p50 and p99 per variant, and the p50 difference to without-meshcni, is printed;
// the metrics are those of the headline variants. The table goes to stdout (the
// testing package cuts a benchmark's log). Run with -benchtime=100x.
func BenchmarkChain(b *testing.B) {
	tbd := testbedAPI(b)
	pods := &swapPods{}
	agentDir := startAgentSocket(b, pods)
	noAgentDir := b.TempDir()
	kc := tbd.Kubeconfig()
	entry := func(runDir string, extra map[string]any) map[string]any {
		m := map[string]any{"plugin_log_level": "warn"}
		for k, v := range extra {
			m[k] = v
		}
		return meshcniEntry(runDir, kc, m)
	}
	type variant struct {
		name   string
		ch     *chain
		plain  bool // a pod that is not meshed
		add    []time.Duration
		del    []time.Duration
		podRef **corev1.Pod
	}
	var plainPod, meshedPod *corev1.Pod
	var vs []*variant
	addVariants := func(prefix, bin string) {
		for _, v := range []struct {
			name  string
			plain bool
			entry map[string]any
		}{
			{"meshcni-not-meshed", true, entry(noAgentDir, nil)},
			{"meshcni-not-meshed-agent", true, entry(agentDir, nil)},
			{"meshcni-meshed", false, entry(noAgentDir, nil)},
			{"meshcni-meshed-agent", false, entry(agentDir, nil)},
			{"meshcni-meshed-iptables-nft", false, entry(noAgentDir, map[string]any{"backend": "iptables-nft"})},
			{"meshcni-meshed-iptables-nft-agent", false, entry(agentDir, map[string]any{"backend": "iptables-nft"})},
		} {
			ref := &meshedPod
			if v.plain {
				ref = &plainPod
			}
			vs = append(vs, &variant{name: prefix + v.name, ch: newChainIn(b, bin, []string{"10.250.0.2/24"}, v.entry), plain: v.plain, podRef: ref})
		}
	}
	vs = append(vs, &variant{name: "without-meshcni", ch: newChainIn(b, binaries(b), []string{"10.250.0.2/24"}, nil), podRef: &meshedPod})
	addVariants("", binaries(b))
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
		addVariants("before-", dir)
	}
	// The pods are bound to a node that does not exist (so that no kubelet runs them
	// and the agent's node-scoped cache holds them); the API server's pod GC deletes
	// such pods after 40 s, so a fresh pair on a fresh node serves each block of rounds.
	const block = 10
	var endBlock func()
	newBlock := func() {
		if endBlock != nil {
			endBlock()
		}
		node := fakeNode()
		c, err := nodepods.New(tbd.Client, node, 0)
		if err != nil {
			b.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { defer close(done); _ = c.Run(ctx) }()
		wctx, wcancel := context.WithTimeout(ctx, 30*time.Second)
		ok := c.WaitForSync(wctx)
		wcancel()
		if !ok {
			b.Fatal("node pod cache did not sync")
		}
		ensureNamespace(b, e2eNamespace)
		var created []*corev1.Pod
		for _, p := range []*corev1.Pod{injectedPod(e2eNamespace, "bench"), injectedPod(e2eNamespace, "bench-plain", withoutProxy)} {
			p.Name = fmt.Sprintf("%s-%04x", p.Name, rand.Uint32()&0xffff)
			no := false
			p.Spec.AutomountServiceAccountToken = &no
			p.Spec.NodeName = node
			got, err := tbd.Client.CoreV1().Pods(e2eNamespace).Create(context.Background(), p, metav1.CreateOptions{})
			if err != nil {
				b.Fatal(err)
			}
			waitCached(b, c, got)
			created = append(created, got)
		}
		meshedPod, plainPod = created[0], created[1]
		pods.set(c)
		endBlock = func() {
			pods.set(nil)
			cancel()
			<-done
			zero := int64(0)
			for _, p := range created {
				_ = tbd.Client.CoreV1().Pods(p.Namespace).Delete(context.Background(), p.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero})
			}
		}
	}
	b.Cleanup(func() {
		if endBlock != nil {
			endBlock()
		}
	})
	ctx := context.Background()
	b.ResetTimer()
	for i := range b.N {
		if i%block == 0 {
			b.StopTimer()
			newBlock()
			b.StartTimer()
		}
		for j := range vs {
			v := vs[(i+j)%len(vs)]
			b.StopTimer()
			netns, err := testutil.CreateNetns(fmt.Sprintf("mcni-bench-%d-%d-%d", os.Getpid(), i, j))
			if err != nil {
				b.Fatal(err)
			}
			rt := runtimeConf(netns, *v.podRef)
			b.StartTimer()
			t0 := time.Now()
			if _, err := v.ch.cfg.AddNetworkList(ctx, v.ch.list, rt); err != nil {
				b.Fatalf("%s: ADD: %v", v.name, err)
			}
			t1 := time.Now()
			if err := v.ch.cfg.DelNetworkList(ctx, v.ch.list, rt); err != nil {
				b.Fatalf("%s: DEL: %v", v.name, err)
			}
			t2 := time.Now()
			b.StopTimer()
			v.add = append(v.add, t1.Sub(t0))
			v.del = append(v.del, t2.Sub(t1))
			if err := testutil.DeleteNetns(netns); err != nil {
				b.Fatal(err)
			}
			b.StartTimer()
		}
	}
	b.StopTimer()
	_, baseAdd, _ := latencies(vs[0].add)
	_, baseDel, _ := latencies(vs[0].del)
	var tbl strings.Builder
	fmt.Fprintf(&tbl, "%d rounds, ms\n%-45s %8s %8s %8s %8s | %8s %8s %8s %8s\n", b.N, "variant", "ADD mean", "p50", "p99", "Δp50", "DEL mean", "p50", "p99", "Δp50")
	for _, v := range vs {
		am, a50, a99 := latencies(v.add)
		dm, d50, d99 := latencies(v.del)
		fmt.Fprintf(&tbl, "%-45s %8.2f %8.2f %8.2f %+8.2f | %8.2f %8.2f %8.2f %+8.2f\n", v.name, am, a50, a99, a50-baseAdd, dm, d50, d99, d50-baseDel)
		switch v.name {
		case "meshcni-meshed-agent", "meshcni-meshed":
			b.ReportMetric(a50-baseAdd, v.name+"-add-p50-delta-ms")
			b.ReportMetric(d50-baseDel, v.name+"-del-p50-delta-ms")
		}
	}
	if b.N > 1 { // not the single warm-up round the testing package runs first
		// To stdout: the testing package cuts a benchmark's log to a few lines.
		fmt.Print(tbl.String())
	}
}

// swapPods is the agent's pod source for BenchmarkChain, which replaces the cache
// (and its node) every block of rounds.
type swapPods struct {
	c atomic.Pointer[nodepods.Cache]
}

func (s *swapPods) set(c *nodepods.Cache) { s.c.Store(c) }
func (s *swapPods) HasSynced() bool {
	c := s.c.Load()
	return c != nil && c.HasSynced()
}
func (s *swapPods) Get(ns, name string) (*corev1.Pod, bool) {
	if c := s.c.Load(); c != nil {
		return c.Get(ns, name)
	}
	return nil, false
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

// proxyContainer is the test pod's istio-proxy container (regular or init).
func proxyContainer(p *corev1.Pod) (*corev1.Container, bool) {
	for _, cs := range [][]corev1.Container{p.Spec.Containers, p.Spec.InitContainers} {
		for i := range cs {
			if cs[i].Name == capture.ProxyContainer {
				return &cs[i], true
			}
		}
	}
	return nil, false
}
