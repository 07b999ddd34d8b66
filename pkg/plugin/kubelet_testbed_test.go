package plugin_test

// The full-node proof: kubelet and containerd (internal/env/testbed, full mode) call the
// conflist bridge + host-local + portmap + meshcni for pods created through the API
// server.

import (
	"context"
	"encoding/json"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/standin/proxysim"
	"github.com/meshcni/meshcni/internal/testkit/traffic"
	"github.com/meshcni/meshcni/pkg/agent"
	"github.com/meshcni/meshcni/pkg/agentsock"
	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/engine"
	"github.com/meshcni/meshcni/pkg/podget"
	"github.com/meshcni/meshcni/pkg/spec"
)

const (
	meshNS     = "mesh-e2e"
	excludedNS = "excluded-e2e"
)

// commands records the CNI command results the plugin reports to the agent socket,
// and the pod lookups the agent answered.
type commands struct {
	mu      sync.Mutex
	list    []agentsock.CommandResult
	lookups []lookup
}

type lookup struct {
	req   agentsock.PodRequest
	found bool
}

func (c *commands) addLookup(req agentsock.PodRequest, found bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.lookups = append(c.lookups, lookup{req, found})
}

// lookupsOf returns the found flags of the lookups of one pod, in order.
func (c *commands) lookupsOf(ns, name string) []bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []bool
	for _, l := range c.lookups {
		if l.req.Namespace == ns && l.req.Name == name {
			out = append(out, l.found)
		}
	}
	return out
}

func (c *commands) add(r *agentsock.CommandResult) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.list = append(c.list, *r)
}

func (c *commands) find(cmd, ns, name string) []agentsock.CommandResult {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []agentsock.CommandResult
	for _, r := range c.list {
		if r.Command == cmd && r.Pod.Namespace == ns && r.Pod.Name == name {
			out = append(out, r)
		}
	}
	return out
}

// installOnNode puts meshcni and its API helper into the test bed's CNI bin dir, writes the agent's run dir
// (kubeconfig + a socket that records command results) and the conflist.
func installOnNode(t *testing.T, tb *testbed.Testbed) *commands {
	t.Helper()
	// The API helper first, as the agent installs them.
	for _, name := range []string{podget.HelperName, "meshcni"} {
		if err := testbed.InstallCNIPlugin(filepath.Join(binaries(t), name), name); err != nil {
			t.Fatal(err)
		}
	}
	runDir, err := os.MkdirTemp("/run", "meshcni-e2e-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(runDir) })
	kc, err := os.ReadFile(tb.Kubeconfig())
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(runDir, "meshcni-kubeconfig"), kc, 0o600); err != nil {
		t.Fatal(err)
	}
	rec := &commands{}
	srv := &agentsock.Server{Path: agentsock.Path(runDir), OnCommand: rec.add, OnLog: func(r *agentsock.LogRecord) {
		t.Logf("plugin %s %s/%s: %s %v", r.Level, r.Pod.Namespace, r.Pod.Name, r.Msg, r.Attrs)
	}}
	// The agent's answer to pod lookups: a real informer cache of the node's pods.
	cache := nodeCache(t, tb, testbed.NodeName)
	srv.OnRequest = func(_ context.Context, req *agentsock.Request) (json.RawMessage, error) {
		if req.Type != agentsock.RequestPod {
			return nil, agentsock.ErrUnsupported
		}
		var pr agentsock.PodRequest
		if err := json.Unmarshal(req.Body, &pr); err != nil {
			return nil, err
		}
		resp, err := agent.AnswerPod(cache, pr)
		if err != nil {
			return nil, err
		}
		rec.addLookup(pr, resp.Found)
		return json.Marshal(resp)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(ctx) }()
	t.Cleanup(func() { cancel(); <-done })

	plugins := append(testbed.DefaultPlugins(), map[string]any{
		"type":               "meshcni",
		"plugin_log_level":   "debug",
		"cni_agent_run_dir":  runDir,
		"exclude_namespaces": []string{"kube-system", excludedNS},
	})
	conf, err := testbed.Conflist(plugins)
	if err != nil {
		t.Fatal(err)
	}
	if err := testbed.WriteConflist(conf); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = testbed.WriteConflist(testbed.DefaultConflist()) })
	return rec
}

// echoPod is testbed.EchoPod in ns; meshed pods get Istio's injection (status
// annotation and an istio-proxy container, here the echo image on the excluded port
// 15021) and no readiness probe (kubelet's probe would be redirected to a proxy).
func nodeEchoPod(ns, name string, meshed bool, mut func(*corev1.Pod)) *corev1.Pod {
	p := testbed.EchoPod(name, 0)
	p.Namespace = ns
	if meshed {
		p.Annotations = map[string]string{capture.AnnotationStatus: `{"containers":["istio-proxy"]}`}
		p.Spec.Containers[0].ReadinessProbe = nil
		p.Spec.Containers = append(p.Spec.Containers, corev1.Container{
			Name: capture.ProxyContainer, Image: testbed.EchoImage, ImagePullPolicy: corev1.PullNever,
			Env: []corev1.EnvVar{{Name: "PORT", Value: "15021"}},
		})
	}
	if mut != nil {
		mut(p)
	}
	return p
}

func TestKubeletChain(t *testing.T) {
	tb := testbed.Shared(t)
	rec := installOnNode(t, tb)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	for _, ns := range []string{meshNS, excludedNS} {
		if err := tb.CreateNamespace(ctx, ns); err != nil && !strings.Contains(err.Error(), "already exists") {
			t.Fatal(err)
		}
	}
	app := traffic.Cred{UID: 1000, GID: 1000}

	t.Run("meshed pod is redirected", func(t *testing.T) {
		pod, err := tb.CreatePod(ctx, nodeEchoPod(meshNS, "meshed", true, nil))
		if err != nil {
			t.Fatal(err)
		}
		if pod, err = tb.WaitPodRunning(ctx, meshNS, pod.Name); err != nil {
			t.Fatal(err)
		}
		netns, err := tb.PodNetns(ctx, meshNS, pod.Name)
		if err != nil {
			t.Fatal(err)
		}
		// Istio's defaults, for the pod's address families.
		s := istioSidecarSpec()
		s.EnableIPv4 = false
		var addrs []netip.Addr
		for _, ip := range pod.Status.PodIPs {
			a := netip.MustParseAddr(ip.IP)
			addrs = append(addrs, a)
			s.EnableIPv4 = s.EnableIPv4 || a.Is4()
		}
		s.EnableIPv6 = spec.IstioIPv6(false, addrs) // no ISTIO_DUAL_STACK on this proxy
		d, err := engine.Check(ctx, engine.Options{Backend: backend.Auto, NetnsPath: netns}, &s)
		if err != nil || !d.Empty() {
			t.Fatalf("rules in the pod: err %v, drift:\n%s", err, d)
		}
		proxy := traffic.StartProxy(t, netns, traffic.ProxyOptions{})
		podIP := netip.MustParseAddr(pod.Status.PodIP)
		out := netip.AddrPortFrom(netip.MustParseAddr(testbed.NodeIP), 8080)
		a := traffic.Dial(t, netns, out, traffic.DialOptions{Cred: app})
		if a.Listener() != proxysim.ListenerOutbound || a.OrigDst() != out {
			t.Fatalf("outbound: %+v (proxy %+v)", a.ProbeResult, a.Proxy)
		}
		in := netip.AddrPortFrom(podIP, testbed.EchoPort)
		a = traffic.Dial(t, hostNetns(), in, traffic.DialOptions{Cred: app})
		if a.Listener() != proxysim.ListenerInbound || a.OrigDst() != in {
			t.Fatalf("inbound from the node: %+v (proxy %+v)", a.ProbeResult, a.Proxy)
		}
		if len(proxy.Records()) < 2 {
			t.Fatalf("proxy records %v", proxy.Records())
		}
		if r := rec.find(agentsock.CommandAdd, meshNS, pod.Name); len(r) == 0 || r[len(r)-1].Result != agentsock.ResultSuccess {
			t.Fatalf("ADD results %+v", r)
		}
		// kubelet's ADD got the pod from the agent's node cache, not the API server.
		if l := rec.lookupsOf(meshNS, pod.Name); len(l) == 0 || !l[len(l)-1] {
			t.Fatalf("pod lookups through the agent: %v, want the last one answered from the cache", l)
		}
		if err := tb.DeletePod(ctx, meshNS, pod.Name); err != nil {
			t.Fatal(err)
		}
		waitUntil(t, 30*time.Second, func() bool { return len(rec.find(agentsock.CommandDel, meshNS, pod.Name)) > 0 })
		for _, r := range rec.find(agentsock.CommandDel, meshNS, pod.Name) {
			if r.Result != agentsock.ResultSuccess {
				t.Fatalf("DEL failed: %+v", r)
			}
		}
	})

	for _, tc := range []struct {
		name, ns string
		meshed   bool // injected, but must be left alone
		mut      func(*corev1.Pod)
	}{
		{"plain", meshNS, false, nil},
		{"excluded-namespace", excludedNS, true, nil},
		{"inject-false", meshNS, true, func(p *corev1.Pod) { p.Labels[capture.AnnotationInject] = "false" }},
	} {
		t.Run(tc.name+" is untouched", func(t *testing.T) {
			p := nodeEchoPod(tc.ns, tc.name, tc.meshed, tc.mut)
			if tc.meshed {
				// Not redirected, so kubelet's probe works: keep it.
				p.Spec.Containers[0].ReadinessProbe = testbed.EchoPod("x", 0).Spec.Containers[0].ReadinessProbe
			}
			pod, err := tb.CreatePod(ctx, p)
			if err != nil {
				t.Fatal(err)
			}
			if pod, err = tb.WaitPodReady(ctx, tc.ns, pod.Name); err != nil {
				t.Fatal(err)
			}
			netns, err := tb.PodNetns(ctx, tc.ns, pod.Name)
			if err != nil {
				t.Fatal(err)
			}
			l, err := engine.Live(ctx, engine.Options{Backend: backend.Auto, NetnsPath: netns})
			if err != nil {
				t.Fatal(err)
			}
			for k, v := range l {
				if strings.TrimSpace(v) != "" {
					t.Fatalf("%s rules in an untouched pod:\n%s", k, v)
				}
			}
			a := traffic.Dial(t, hostNetns(), netip.AddrPortFrom(netip.MustParseAddr(pod.Status.PodIP), testbed.EchoPort), traffic.DialOptions{Cred: app})
			if a.Error != "" || !strings.Contains(a.Reply, tc.name) {
				t.Fatalf("echo not reached directly: %+v", a.ProbeResult)
			}
			if err := tb.DeletePod(ctx, tc.ns, pod.Name); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func waitUntil(t *testing.T, d time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("condition not met within %s", d)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// hostNetns is the node's network namespace: the one the test binary started in
// (the test bed's bridge lives there), held open from TestMain. /proc/PID/ns/net is
// not it: a goroutine that left its locked thread in another namespace may have
// wedged the main thread there.
func hostNetns() string { return hostNetnsPath }
