package plugin

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/internal/standin/fakeapi"
	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/engine"
	"github.com/meshcni/meshcni/pkg/podget/helper"
	"github.com/meshcni/meshcni/pkg/rules"
	"github.com/meshcni/meshcni/pkg/spec"
)

// fakeEngine records calls (unit tests only; the netns tests use pkg/engine).
type fakeEngine struct {
	mu      sync.Mutex
	applied []*spec.Spec
	opts    []engine.Options
	cleaned []string
	drift   backend.Drift
	err     error
}

func (f *fakeEngine) Apply(_ context.Context, o engine.Options, s *spec.Spec) (backend.Kind, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.err != nil {
		return "", f.err
	}
	f.applied = append(f.applied, s)
	f.opts = append(f.opts, o)
	return backend.Nftables, nil
}

func (f *fakeEngine) Check(context.Context, engine.Options, *spec.Spec) (backend.Drift, error) {
	return f.drift, f.err
}

func (f *fakeEngine) Clean(_ context.Context, o engine.Options) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.cleaned = append(f.cleaned, o.NetnsPath)
	return f.err
}

const prevResult100 = `{"cniVersion":"1.0.0","interfaces":[{"name":"eth0","mac":"0a:58:0a:00:00:05","sandbox":"/var/run/netns/x"}],
"ips":[{"interface":0,"address":"10.0.0.5/24","gateway":"10.0.0.1"},{"interface":0,"address":"fd00::5/64"}],"dns":{}}`

// conf renders a meshcni configuration; extra is merged at the top level.
func conf(t *testing.T, cniVersion string, runDir string, prev string, extra map[string]any) []byte {
	t.Helper()
	m := map[string]any{
		"cniVersion":         cniVersion,
		"name":               "k8s-pod-network",
		"type":               "meshcni",
		"plugin_log_level":   "debug",
		"cni_agent_run_dir":  runDir,
		"exclude_namespaces": []string{"kube-system"},
		"api_timeout":        "1s",
	}
	if prev != "" {
		m["prevResult"] = json.RawMessage(prev)
	}
	for k, v := range extra {
		m[k] = v
	}
	b, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

type harness struct {
	p      *Plugin
	eng    *fakeEngine
	api    *fakeapi.Server
	runDir string
	stdout *bytes.Buffer
	stderr *bytes.Buffer
	gets   int
}

func newHarness(t *testing.T) *harness {
	h := &harness{eng: &fakeEngine{}, api: fakeapi.New(t, "tok"), runDir: t.TempDir(), stdout: &bytes.Buffer{}, stderr: &bytes.Buffer{}}
	h.api.Kubeconfig(t, filepath.Join(h.runDir, KubeconfigName))
	h.p = New()
	h.p.Engine, h.p.Stdout, h.p.Stderr = h.eng, h.stdout, h.stderr
	helper := filepath.Join(t.TempDir(), "meshcni-podget")
	if err := os.WriteFile(helper, nil, 0o755); err != nil {
		t.Fatal(err)
	}
	h.p.HelperPath = func() (string, error) { return helper, nil }
	// In-process: the helper's own code (podget/helper) without its exec, which the
	// real-API and test-bed tests run.
	h.p.NewPodGetter = func(path string) (PodGetter, error) {
		h.gets++
		return &inProcessGetter{kubeconfig: path}, nil
	}
	return h
}

// inProcessGetter is the helper's work (helper.Request) in the test process.
type inProcessGetter struct {
	kubeconfig string
	server     string
}

func (g *inProcessGetter) GetPod(ctx context.Context, namespace, name string) (*capture.Pod, error) {
	timeout := 5 * time.Second
	if d, ok := ctx.Deadline(); ok {
		timeout = time.Until(d)
	}
	r := helper.Request{Kubeconfig: g.kubeconfig, Namespace: namespace, Name: name, Timeout: timeout, Backoff: 20 * time.Millisecond}.Do(ctx)
	g.server = r.Server
	return r.Outcome()
}

func (g *inProcessGetter) Server() string { return g.server }

func cmdArgs(ns, name, uid string, stdin []byte) *skel.CmdArgs {
	a := fmt.Sprintf("IgnoreUnknown=1;K8S_POD_NAMESPACE=%s;K8S_POD_NAME=%s;K8S_POD_INFRA_CONTAINER_ID=abc", ns, name)
	if uid != "" {
		a += ";K8S_POD_UID=" + uid
	}
	if ns == "" {
		a = ""
	}
	return &skel.CmdArgs{ContainerID: "0123456789abcdef", Netns: "/var/run/netns/none", IfName: "eth0", Args: a, StdinData: stdin}
}

func meshed(ns, name string, annotations map[string]string) *corev1.Pod {
	a := map[string]string{capture.AnnotationStatus: "{}"}
	for k, v := range annotations {
		a[k] = v
	}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, UID: "uid-" + "web", Annotations: a},
		Spec: corev1.PodSpec{Containers: []corev1.Container{
			{Name: "app"}, {Name: capture.ProxyContainer, Args: []string{"proxy", "sidecar"}},
		}},
	}
}

func cniErr(t *testing.T, err error) *types.Error {
	t.Helper()
	var e *types.Error
	if !errors.As(err, &e) {
		t.Fatalf("error %v (%T) is not a *types.Error", err, err)
	}
	return e
}

func TestAddMeshedAppliesAndPassesResultThrough(t *testing.T) {
	for _, ver := range []string{"0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"} {
		t.Run(ver, func(t *testing.T) {
			h := newHarness(t)
			h.api.AddPod(meshed("app", "web", map[string]string{capture.AnnotationExcludeOutboundPorts: "9999"}))
			prev := strings.Replace(prevResult100, `"1.0.0"`, `"`+ver+`"`, 1)
			if strings.HasPrefix(ver, "0.") {
				prev = strings.Replace(prev, `"interface":0,`, `"version":"4","interface":0,`, 1)
				prev = strings.Replace(prev, `{"interface":0,"address":"fd00`, `{"version":"6","interface":0,"address":"fd00`, 1)
			}
			if err := h.p.Add(cmdArgs("app", "web", "uid-web", conf(t, ver, h.runDir, prev, nil))); err != nil {
				t.Fatal(err)
			}
			if len(h.eng.applied) != 1 {
				t.Fatalf("applied %d times", len(h.eng.applied))
			}
			s := h.eng.applied[0]
			// A dual-stack prevResult, a proxy without ISTIO_DUAL_STACK: IPv4 rules only,
			// as Istio decides (TestAddIPv6 covers the rest).
			if !s.EnableIPv4 || s.EnableIPv6 || s.IPv6 != spec.IPv6Istio || len(s.OutboundPortsExclude) != 1 || s.OutboundPortsExclude[0] != 9999 {
				t.Fatalf("spec %+v", s)
			}
			if h.eng.opts[0].NetnsPath != "/var/run/netns/none" || h.eng.opts[0].Backend != backend.Auto {
				t.Fatalf("options %+v", h.eng.opts[0])
			}
			var out map[string]any
			if err := json.Unmarshal(h.stdout.Bytes(), &out); err != nil {
				t.Fatalf("stdout %q: %v", h.stdout, err)
			}
			if out["cniVersion"] != ver {
				t.Fatalf("result version %v, want %s", out["cniVersion"], ver)
			}
			ips, _ := out["ips"].([]any)
			if len(ips) != 2 {
				t.Fatalf("result ips %v", out["ips"])
			}
			if !strings.Contains(h.stderr.String(), "pod meshed: redirect applied") {
				t.Fatalf("log: %s", h.stderr)
			}
		})
	}
}

func TestAddSkipsWithoutTouchingTheAPI(t *testing.T) {
	h := newHarness(t)
	// A kubeconfig that does not exist: reading it would fail the call.
	c := conf(t, "1.0.0", "/nonexistent/run", prevResult100, nil)
	for _, a := range []*skel.CmdArgs{cmdArgs("", "", "", c), cmdArgs("kube-system", "coredns", "", c)} {
		h.stdout.Reset()
		if err := h.p.Add(a); err != nil {
			t.Fatalf("%s: %v", a.Args, err)
		}
		if h.stdout.Len() == 0 {
			t.Fatal("no result printed")
		}
	}
	if h.gets != 0 || h.api.Hits() != 0 {
		t.Fatalf("kubeconfig loaded %d times, API hit %d times", h.gets, h.api.Hits())
	}
	if !strings.Contains(h.stderr.String(), "not a Kubernetes pod") || !strings.Contains(h.stderr.String(), "namespace kube-system is excluded") {
		t.Fatalf("log: %s", h.stderr)
	}
}

func TestAddNotMeshed(t *testing.T) {
	h := newHarness(t)
	plain := meshed("app", "plain", nil)
	plain.Spec.Containers = plain.Spec.Containers[:1]
	h.api.AddPod(plain)
	optout := meshed("app", "optout", nil)
	optout.Labels = map[string]string{capture.AnnotationInject: "false"}
	h.api.AddPod(optout)
	for _, name := range []string{"plain", "optout"} {
		if err := h.p.Add(cmdArgs("app", name, "", conf(t, "1.0.0", h.runDir, prevResult100, nil))); err != nil {
			t.Fatal(err)
		}
	}
	if len(h.eng.applied) != 0 {
		t.Fatal("rules applied to a pod that is not meshed")
	}
	log := h.stderr.String()
	if !strings.Contains(log, "no istio-proxy container") || !strings.Contains(log, "label sidecar.istio.io/inject=false") {
		t.Fatalf("log: %s", log)
	}
}

func TestAddFailures(t *testing.T) {
	tests := []struct {
		name  string
		setup func(h *harness) *skel.CmdArgs
		code  uint
		want  []string
	}{
		{"api forbidden", func(h *harness) *skel.CmdArgs {
			h.api.SetStatus(403)
			return cmdArgs("app", "web", "", conf(t, "1.0.0", h.runDir, prevResult100, nil))
		}, types.ErrInternal, []string{"refused to let meshcni get pod app/web", "403 Forbidden", "cannot get resource", "fails closed", "RBAC"}},
		{"pod not found", func(h *harness) *skel.CmdArgs {
			return cmdArgs("app", "ghost", "", conf(t, "1.0.0", h.runDir, prevResult100, map[string]any{"api_timeout": 0.3}))
		}, types.ErrInternal, []string{"pod app/ghost not found", "fails closed"}},
		{"uid mismatch", func(h *harness) *skel.CmdArgs {
			h.api.AddPod(meshed("app", "web", nil))
			return cmdArgs("app", "web", "uid-old", conf(t, "1.0.0", h.runDir, prevResult100, nil))
		}, types.ErrInternal, []string{"has UID uid-web but the runtime is creating UID uid-old"}},
		{"wrong pod in the answer", func(h *harness) *skel.CmdArgs {
			other := meshed("app", "other", nil)
			h.api.AddPod(other)
			h.api.SetPod("app/web", other)
			return cmdArgs("app", "web", "", conf(t, "1.0.0", h.runDir, prevResult100, nil))
		}, types.ErrInternal, []string{"answered the GET of pod app/web with pod app/other"}},
		{"bad annotation", func(h *harness) *skel.CmdArgs {
			h.api.AddPod(meshed("app", "web", map[string]string{capture.AnnotationIncludeInboundPorts: "80,http"}))
			return cmdArgs("app", "web", "", conf(t, "1.0.0", h.runDir, prevResult100, nil))
		}, types.ErrInvalidNetworkConfig, []string{`traffic.sidecar.istio.io/includeInboundPorts "80,http"`, "no redirect rule was applied"}},
		{"bad IPv6 mode annotation", func(h *harness) *skel.CmdArgs {
			h.api.AddPod(meshed("app", "web", map[string]string{capture.AnnotationIPv6: "pass"}))
			return cmdArgs("app", "web", "", conf(t, "1.0.0", h.runDir, prevResult100, nil))
		}, types.ErrInvalidNetworkConfig, []string{`invalid meshcni.io/ipv6 "pass": want istio, capture or drop`, "no redirect rule was applied"}},
		{"bad eBPF acceleration annotation", func(h *harness) *skel.CmdArgs {
			h.api.AddPod(meshed("app", "web", map[string]string{capture.AnnotationEBPFAcceleration: "on"}))
			return cmdArgs("app", "web", "", conf(t, "1.0.0", h.runDir, prevResult100, nil))
		}, types.ErrInvalidNetworkConfig, []string{`invalid meshcni.io/ebpf-acceleration "on": want off, to-proxy or both`, "no redirect rule was applied"}},
		{"no prevResult and no address in the netns", func(h *harness) *skel.CmdArgs {
			// meshcni listed before the plugin that creates the pod's interface.
			h.api.AddPod(meshed("app", "web", nil))
			h.p.PodAddrs = (&fakeAddrs{}).read
			return cmdArgs("app", "web", "", conf(t, "1.0.0", h.runDir, "", nil))
		}, types.ErrInvalidNetworkConfig, []string{"no prevResult", "holds no address", "list it after the plugin that creates the pod's interface", "Multus", "fails closed"}},
		{"kubeconfig missing", func(h *harness) *skel.CmdArgs {
			return cmdArgs("app", "web", "", conf(t, "1.0.0", "/nonexistent/run", prevResult100, nil))
		}, types.ErrTryAgainLater, []string{"cannot load its kubeconfig", "/nonexistent/run/meshcni-kubeconfig", "meshcni-agent is running"}},
		{"engine fails", func(h *harness) *skel.CmdArgs {
			h.api.AddPod(meshed("app", "web", nil))
			h.eng.err = errors.New("nft: boom")
			return cmdArgs("app", "web", "", conf(t, "1.0.0", h.runDir, prevResult100, nil))
		}, types.ErrInternal, []string{"cannot apply the traffic redirect of pod app/web", "nft: boom", "fails closed"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t)
			err := h.p.Add(tt.setup(h))
			if err == nil {
				t.Fatal("no error")
			}
			e := cniErr(t, err)
			if e.Code != tt.code {
				t.Errorf("code %d, want %d (%s)", e.Code, tt.code, e.Msg)
			}
			for _, w := range tt.want {
				if !strings.Contains(e.Msg, w) {
					t.Errorf("message %q lacks %q", e.Msg, w)
				}
			}
			if len(h.eng.applied) != 0 {
				t.Error("rules applied despite the failure")
			}
			if h.stdout.Len() != 0 {
				t.Errorf("stdout holds %q on failure", h.stdout)
			}
		})
	}
}

// TestAddIPv6: the spec ADD applies for a dual-stack pod (prevResult100): IPv6 rules
// as Istio decides from the proxy's ISTIO_DUAL_STACK, and the IPv6 mode from the
// pod's meshcni.io/ipv6, else the plugin's ipv6 key, else istio.
func TestAddIPv6(t *testing.T) {
	dual := func(p *corev1.Pod) *corev1.Pod {
		p.Spec.Containers[1].Env = []corev1.EnvVar{{Name: capture.EnvDualStack, Value: "true"}}
		return p
	}
	for _, tt := range []struct {
		name        string
		pod         *corev1.Pod
		key         any // the plugin's ipv6 key; nil: absent
		captured    bool
		enable      bool
		mode        spec.IPv6Mode
		ipv6Written bool
	}{
		{"single-stack proxy", meshed("app", "web", nil), nil, false, false, spec.IPv6Istio, false},
		{"dual-stack proxy", dual(meshed("app", "web", nil)), nil, true, true, spec.IPv6Istio, true},
		{"plugin key capture", meshed("app", "web", nil), "capture", true, false, spec.IPv6Capture, true},
		{"plugin key drop", meshed("app", "web", nil), "drop", false, false, spec.IPv6Drop, true},
		{"annotation wins over the key", meshed("app", "web", map[string]string{capture.AnnotationIPv6: "istio"}), "drop", false, false, spec.IPv6Istio, false},
		{"annotation capture", meshed("app", "web", map[string]string{capture.AnnotationIPv6: "capture"}), nil, true, false, spec.IPv6Capture, true},
		{"drop with a dual-stack proxy captures", dual(meshed("app", "web", map[string]string{capture.AnnotationIPv6: "drop"})), nil, true, true, spec.IPv6Drop, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t)
			h.api.AddPod(tt.pod)
			extra := map[string]any{}
			if tt.key != nil {
				extra["ipv6"] = tt.key
			}
			if err := h.p.Add(cmdArgs("app", "web", "uid-web", conf(t, "1.0.0", h.runDir, prevResult100, extra))); err != nil {
				t.Fatal(err)
			}
			s := h.eng.applied[0]
			if !s.EnableIPv4 || s.EnableIPv6 != tt.enable || s.IPv6 != tt.mode || s.IPv6Captured() != tt.captured {
				t.Fatalf("EnableIPv4 %v EnableIPv6 %v IPv6 %q captured %v; want true %v %q %v", s.EnableIPv4, s.EnableIPv6, s.IPv6, s.IPv6Captured(), tt.enable, tt.mode, tt.captured)
			}
			if got := len(rules.Build(s).Resolve(rules.V6)) > 0; got != tt.ipv6Written {
				t.Errorf("ip6tables rules written: %v, want %v", got, tt.ipv6Written)
			}
		})
	}
}

// TestAddRejectsImpossiblePodNames: a namespace or name Kubernetes cannot hold never
// reaches the API helper's URL (a name of ".." would GET the namespace itself).
func TestAddRejectsImpossiblePodNames(t *testing.T) {
	h := newHarness(t)
	for _, tc := range []struct{ ns, name string }{{"app", ".."}, {"app", "a/b"}, {"app", "Web"}, {"App", "web"}, {"app", strings.Repeat("a", 254)}} {
		e := cniErr(t, h.p.Add(cmdArgs(tc.ns, tc.name, "", conf(t, "1.0.0", h.runDir, prevResult100, nil))))
		if e.Code != types.ErrInvalidEnvironmentVariables || !strings.Contains(e.Msg, "cannot hold") {
			t.Errorf("%s/%s: %+v", tc.ns, tc.name, e)
		}
	}
	if h.gets != 0 || h.api.Hits() != 0 {
		t.Fatalf("API asked %d/%d times", h.gets, h.api.Hits())
	}
	for _, name := range []string{"web-0", "web.v2", strings.Repeat("a", 100)} {
		if !isPodName(name) {
			t.Errorf("isPodName(%q) = false", name)
		}
	}
}

func TestAddAPIUnreachableFailsClosedWithinDeadline(t *testing.T) {
	h := newHarness(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	kc := filepath.Join(h.runDir, KubeconfigName)
	doc := fmt.Sprintf("current-context: x\nclusters: [{name: c, cluster: {server: 'https://%s', insecure-skip-tls-verify: true}}]\nusers: [{name: u, user: {token: t}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\n", addr)
	if err := os.WriteFile(kc, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	err = h.p.Add(cmdArgs("app", "web", "", conf(t, "1.0.0", h.runDir, prevResult100, map[string]any{"api_timeout": "700ms"})))
	took := time.Since(start)
	e := cniErr(t, err)
	if e.Code != types.ErrTryAgainLater {
		t.Errorf("code %d", e.Code)
	}
	for _, w := range []string{"cannot reach the Kubernetes API at https://" + addr, "fails closed so the pod is not started unredirected", "check that meshcni-agent is running on this node"} {
		if !strings.Contains(e.Msg, w) {
			t.Errorf("message %q lacks %q", e.Msg, w)
		}
	}
	if took < 600*time.Millisecond || took > 3*time.Second {
		t.Errorf("took %s with a 700ms deadline", took)
	}
}

// A static pod runs with kubelet's UID; its mirror pod in the API carries it in the
// kubernetes.io/config.mirror annotation.
func TestAddStaticPodMirrorUID(t *testing.T) {
	h := newHarness(t)
	p := meshed("kube-public", "static-web", nil)
	p.Annotations["kubernetes.io/config.mirror"] = "static-uid"
	h.api.AddPod(p)
	if err := h.p.Add(cmdArgs("kube-public", "static-web", "static-uid", conf(t, "1.0.0", h.runDir, prevResult100, nil))); err != nil {
		t.Fatal(err)
	}
	if len(h.eng.applied) != 1 {
		t.Fatal("not applied")
	}
}

func TestDel(t *testing.T) {
	h := newHarness(t)
	// The netns does not exist: success, nothing cleaned, no API.
	c := conf(t, "1.0.0", "/nonexistent/run", "", nil)
	if err := h.p.Del(cmdArgs("app", "web", "", c)); err != nil {
		t.Fatal(err)
	}
	a := cmdArgs("app", "web", "", c)
	a.Netns = ""
	if err := h.p.Del(a); err != nil {
		t.Fatal(err)
	}
	if len(h.eng.cleaned) != 0 || h.gets != 0 {
		t.Fatalf("cleaned %v, kubeconfig loads %d", h.eng.cleaned, h.gets)
	}
	// The netns exists (our own): Clean is called with it.
	a = cmdArgs("app", "web", "", c)
	a.Netns = "/proc/self/ns/net"
	if err := h.p.Del(a); err != nil {
		t.Fatal(err)
	}
	if len(h.eng.cleaned) != 1 || h.eng.cleaned[0] != "/proc/self/ns/net" {
		t.Fatalf("cleaned %v", h.eng.cleaned)
	}
	// A prevResult DEL cannot read (the runtime's cache, another version's) does not
	// stop DEL; ADD with it fails with a message naming it.
	for _, bad := range []string{`"not an object"`, `{"cniVersion":"1.0.0","ips":"x"}`} {
		c := conf(t, "1.0.0", "/nonexistent/run", bad, nil)
		a := cmdArgs("app", "web", "", c)
		a.Netns = "/proc/self/ns/net"
		if err := h.p.Del(a); err != nil {
			t.Errorf("DEL with prevResult %s: %v", bad, err)
		}
		err := h.p.Add(cmdArgs("app", "web", "", c))
		var e *types.Error
		if !errors.As(err, &e) || e.Code != types.ErrDecodingFailure || !strings.Contains(e.Msg, "prevResult") {
			t.Errorf("ADD with prevResult %s: %v", bad, err)
		}
	}
	if len(h.eng.cleaned) != 3 {
		t.Fatalf("cleaned %v", h.eng.cleaned)
	}
}

func TestCheck(t *testing.T) {
	h := newHarness(t)
	h.api.AddPod(meshed("app", "web", nil))
	c := conf(t, "1.0.0", h.runDir, prevResult100, nil)
	if err := h.p.Check(cmdArgs("app", "web", "", c)); err != nil {
		t.Fatal(err)
	}
	h.eng.drift = backend.Drift{Missing: []string{"nat ISTIO_OUTPUT -j ISTIO_REDIRECT"}}
	e := cniErr(t, h.p.Check(cmdArgs("app", "web", "", c)))
	if !strings.Contains(e.Msg, "drifted") || !strings.Contains(e.Details, "missing:    nat ISTIO_OUTPUT") {
		t.Fatalf("%+v", e)
	}
	// Not meshed: nothing to check, whatever the engine says.
	plain := meshed("app", "plain", nil)
	plain.Annotations = nil
	h.api.AddPod(plain)
	if err := h.p.Check(cmdArgs("app", "plain", "", c)); err != nil {
		t.Fatal(err)
	}
}

func TestStatusAndGC(t *testing.T) {
	h := newHarness(t)
	if err := h.p.Status(&skel.CmdArgs{StdinData: conf(t, "1.1.0", h.runDir, "", nil)}); err != nil {
		t.Fatalf("ready: %v", err)
	}
	e := cniErr(t, h.p.Status(&skel.CmdArgs{StdinData: conf(t, "1.1.0", t.TempDir(), "", nil)}))
	if e.Code != types.ErrPluginNotAvailable || !strings.Contains(e.Msg, "meshcni-kubeconfig is missing") {
		t.Fatalf("%+v", e)
	}
	// The API helper missing: not ready either, naming it.
	h.p.HelperPath = func() (string, error) { return filepath.Join(t.TempDir(), "meshcni-podget"), nil }
	e = cniErr(t, h.p.Status(&skel.CmdArgs{StdinData: conf(t, "1.1.0", h.runDir, "", nil)}))
	if e.Code != types.ErrPluginNotAvailable || !strings.Contains(e.Msg, "API helper meshcni-podget is missing") {
		t.Fatalf("%+v", e)
	}
	if err := h.p.GC(&skel.CmdArgs{StdinData: conf(t, "1.1.0", h.runDir, "", nil)}); err != nil {
		t.Fatal(err)
	}
}

func TestParseConfig(t *testing.T) {
	base := func(extra string) []byte {
		return []byte(`{"cniVersion":"1.0.0","name":"n","type":"meshcni","cni_agent_run_dir":"/run/meshcni"` + extra + `}`)
	}
	c, err := ParseConfig(base(`,"kubernetes":{"kubeconfig":"/etc/cni/net.d/zz","exclude_namespaces":["istio-system"],"cni_bin_dir":"/opt/cni/bin"},"exclude_namespaces":["kube-system","istio-system"],"native_nftables":true,"api_timeout":5`))
	if err != nil {
		t.Fatal(err)
	}
	if c.Kubeconfig != "/etc/cni/net.d/zz" || c.Backend != backend.Nftables || c.APITimeout != 5*time.Second ||
		strings.Join(c.ExcludeNamespaces, ",") != "kube-system,istio-system" {
		t.Fatalf("%+v", c)
	}
	c, err = ParseConfig(base(``))
	if err != nil {
		t.Fatal(err)
	}
	if c.Kubeconfig != "/run/meshcni/meshcni-kubeconfig" || c.Backend != backend.Auto || c.APITimeout != DefaultAPITimeout {
		t.Fatalf("%+v", c)
	}
	if c.IPv6 != spec.IPv6Istio {
		t.Errorf("ipv6 default %q, want istio", c.IPv6)
	}
	for _, m := range []struct{ in, want string }{{"istio", "istio"}, {"capture", "capture"}, {"Drop", "drop"}} {
		c, err := ParseConfig(base(`,"ipv6":"` + m.in + `"`))
		if err != nil || string(c.IPv6) != m.want || c.CaptureConfig().IPv6 != spec.IPv6Mode(m.want) {
			t.Errorf("ipv6 %s: %v %v", m.in, c, err)
		}
	}
	for _, b := range []struct{ in, want string }{{"iptables-legacy", "iptables-legacy"}, {"iptables-nft", "iptables-nft"}, {"iptables", "iptables-nft"}, {"nftables", "nftables"}, {"auto", "auto"}} {
		c, err := ParseConfig(base(`,"backend":"` + b.in + `"`))
		if err != nil || string(c.Backend) != b.want {
			t.Errorf("backend %s: %v %v", b.in, c, err)
		}
	}
	for _, tt := range []struct {
		doc  []byte
		code uint
		want string
	}{
		{[]byte(`{"cniVersion":"1.0.0",`), types.ErrDecodingFailure, "malformed JSON"},
		{base(`,"exclude_namespaces":"kube-system"`), types.ErrDecodingFailure, "exclude_namespaces"},
		{base(`,"plugin_log_level":"loud"`), types.ErrInvalidNetworkConfig, `plugin_log_level "loud"`},
		{base(`,"backend":"ebpf"`), types.ErrInvalidNetworkConfig, `backend "ebpf"`},
		{base(`,"backend":"iptables-legacy","native_nftables":true`), types.ErrInvalidNetworkConfig, "native_nftables"},
		{base(`,"api_timeout":"soon"`), types.ErrInvalidNetworkConfig, `api_timeout "soon"`},
		{base(`,"api_timeout":-1`), types.ErrInvalidNetworkConfig, "api_timeout -1"},
		{base(`,"exclude_namespaces":["Bad_NS"]`), types.ErrInvalidNetworkConfig, `exclude_namespaces "Bad_NS"`},
		{base(`,"type":"istio-cni"`), types.ErrInvalidNetworkConfig, `type "istio-cni"`},
		{base(`,"agent_pod_label":"a b"`), types.ErrInvalidNetworkConfig, "agent_pod_label"},
		{base(`,"ipv6":"pass"`), types.ErrInvalidNetworkConfig, `ipv6 "pass": want istio, capture or drop`},
		{base(`,"ipv6":true`), types.ErrDecodingFailure, "ipv6"},
		{base(`,"agent_pod_namespace":"Not_A_Namespace"`), types.ErrInvalidNetworkConfig, "agent_pod_namespace"},
		{[]byte(`{"cniVersion":"1.0.0","name":"n","type":"meshcni","cni_agent_run_dir":"run/meshcni"}`), types.ErrInvalidNetworkConfig, `cni_agent_run_dir "run/meshcni"`},
		{[]byte(`{"cniVersion":"1.0.0","name":"n","type":"meshcni"}`), types.ErrInvalidNetworkConfig, "cni_agent_run_dir"},
		{base(`,"prevResult":{"ips":"x"}`), types.ErrDecodingFailure, "prevResult"},
	} {
		_, err := ParseConfig(tt.doc)
		if err == nil {
			t.Errorf("%s: no error", tt.doc)
			continue
		}
		e := cniErr(t, err)
		if e.Code != tt.code || !strings.Contains(e.Msg, tt.want) {
			t.Errorf("%s: got %d %q, want %d containing %q", tt.doc, e.Code, e.Msg, tt.code, tt.want)
		}
	}
}
