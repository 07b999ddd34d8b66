package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/testkit/agenttest"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/engine"
	"github.com/meshcni/meshcni/pkg/netnsutil"
	"github.com/meshcni/meshcni/pkg/spec"
)

func TestMain(m *testing.M) {
	code := testbed.RunMainThen(m, removeIstio)
	agenttest.RemoveBinaries()
	os.Exit(code)
}

// ctl runs meshcnictl in-process as main does and returns stdout, the exit code and
// the error main would print.
func ctl(t *testing.T, args ...string) (string, int, error) {
	t.Helper()
	root := newRoot()
	var out bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&out)
	root.SetArgs(args)
	err := root.Execute()
	code := 0
	if err != nil {
		code = 1
		var ee *exitError
		if errors.As(err, &ee) {
			code = ee.code
		}
	}
	return out.String(), code, err
}

func TestPodRef(t *testing.T) {
	for _, tc := range []struct {
		ref, ns          string
		wantNS, wantName string
		wantErrSubstring string
	}{
		{"web", "default", "default", "web", ""},
		{"web", "app", "app", "web", ""},
		{"shop/web-0", "app", "shop", "web-0", ""},
		{"Web", "default", "", "", `pod name "Web"`},
		{"a/b/c", "default", "", "", `pod name "b/c"`},
		{"/web", "default", "", "", `namespace ""`},
		{"web", "", "", "", `namespace ""`},
	} {
		ns, name, err := podRef(tc.ref, tc.ns)
		if tc.wantErrSubstring != "" {
			if err == nil || !strings.Contains(err.Error(), tc.wantErrSubstring) {
				t.Errorf("podRef(%q, %q) = %q, %q, %v; want error with %q", tc.ref, tc.ns, ns, name, err, tc.wantErrSubstring)
			}
			continue
		}
		if err != nil || ns != tc.wantNS || name != tc.wantName {
			t.Errorf("podRef(%q, %q) = %q, %q, %v; want %q, %q", tc.ref, tc.ns, ns, name, err, tc.wantNS, tc.wantName)
		}
	}
}

func TestInspectUsage(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "nope")
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"nothing to inspect", []string{"inspect"}, "give a pod"},
		{"two arguments", []string{"inspect", "a", "b"}, "accepts at most 1 arg"},
		{"bad output", []string{"inspect", "-o", "wide", "web"}, `-o "wide": want text, json or yaml`},
		{"unknown flag", []string{"inspect", "--bogus"}, "unknown flag: --bogus"},
		{"bad backend", []string{"inspect", "--backend", "pf", "web"}, "--backend"},
		{"netns twice", []string{"inspect", "--netns", missing, missing}, "either as the argument or with --netns"},
		{"missing netns", []string{"inspect", missing}, "no such file"},
		{"bad pod name", []string{"inspect", "--kubeconfig", missing, "Not_A_Pod"}, `pod name "Not_A_Pod"`},
		{"unreadable kubeconfig", []string{"inspect", "--kubeconfig", missing, "ns/web"}, "kubeconfig " + missing},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, code, err := ctl(t, tc.args...)
			if code != exitUsage || err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("exit %d, err %v; want exit %d and %q", code, err, exitUsage, tc.want)
			}
		})
	}
}

// TestInspectNetns inspects bare namespaces: rules applied by the engine are shown
// (whichever backend holds them), an empty namespace has none; both exit 0.
func TestInspectNetns(t *testing.T) {
	testutil.RequireRoot(t)
	ctx := context.Background()
	empty := testutil.NewNetns(t)
	s := spec.PodDefaults()
	for _, k := range []backend.Kind{backend.Nftables, backend.IptablesNft} {
		t.Run(string(k), func(t *testing.T) {
			if k == backend.IptablesNft {
				testutil.RequireBinary(t, "iptables-nft-restore")
			}
			ns := testutil.NewNetns(t)
			if _, err := engine.Apply(ctx, engine.Options{Backend: k, NetnsPath: ns}, &s); err != nil {
				t.Fatal(err)
			}
			out, code, err := ctl(t, "inspect", ns)
			if code != 0 || err != nil {
				t.Fatalf("exit %d: %v\n%s", code, err, out)
			}
			for _, want := range []string{"netns:    " + ns, "live:     " + string(k), "15006", "result:   live rules only"} {
				if !strings.Contains(out, want) {
					t.Errorf("output lacks %q:\n%s", want, out)
				}
			}
		})
	}
	out, code, err := ctl(t, "inspect", "--netns", empty, "-o", "json")
	if code != 0 || err != nil {
		t.Fatalf("exit %d: %v\n%s", code, err, out)
	}
	var r inspectReport
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		t.Fatalf("json: %v\n%s", err, out)
	}
	if r.Status != statusLiveOnly || len(r.Live) != 0 || r.Netns != empty {
		t.Fatalf("report %+v", r)
	}
}

// The test bed's containerd keeps its netns files here (docs/testing.md).
var testbedNetnsDir = testbed.NetnsDir

const inspectNS = "inspect-e2e"

// echoPod is the test bed's echo pod in inspectNS; a meshed one carries Istio's
// injection (status annotation, an istio-proxy container: the echo image on the
// excluded port 15021) and no readiness probe (it would be redirected).
func echoPod(name string, meshed bool) *corev1.Pod {
	p := testbed.EchoPod(name, 0)
	p.Namespace = inspectNS
	if meshed {
		p.Annotations = map[string]string{
			capture.AnnotationStatus:                  `{"containers":["istio-proxy"]}`,
			capture.AnnotationExcludeOutboundPorts:    "5432",
			capture.AnnotationExcludeOutboundIPRanges: "10.214.0.0/16",
		}
		p.Spec.Containers[0].ReadinessProbe = nil
		p.Spec.Containers = append(p.Spec.Containers, corev1.Container{
			Name: capture.ProxyContainer, Image: testbed.EchoImage, ImagePullPolicy: corev1.PullNever,
			Env: []corev1.EnvVar{{Name: "PORT", Value: "15021"}},
		})
	}
	return p
}

// breakRules flushes one chain of meshcni's nftables NAT table in the netns: the
// redirect is partial, as after a bad hand edit.
func breakRules(t *testing.T, netns string) {
	t.Helper()
	f, err := os.Open(netns)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	conn, err := nftables.New(nftables.WithNetNSFd(int(f.Fd())))
	if err != nil {
		t.Fatal(err)
	}
	table := &nftables.Table{Name: "istio-proxy-nat", Family: nftables.TableFamilyINet}
	conn.FlushChain(&nftables.Chain{Name: "istio-inbound", Table: table})
	if err := conn.Flush(); err != nil {
		t.Fatalf("flush istio-inbound in %s: %v", netns, err)
	}
}

// TestInspectExplainTestbed proves inspect and explain on real pods started by the
// kubelet through the CNI chain with meshcni: a meshed pod (in sync, exit 0), a
// plain pod (not meshed, exit 0), a broken one (meshed, a chain flushed: drift,
// exit 1), a plain pod with meshcni rules (exit 1), and a pod on another node (exit 2).
func TestInspectExplainTestbed(t *testing.T) {
	tb := testbed.Shared(t)
	// The real agent puts meshcni at the end of the test bed's chain (and takes it out
	// when the test ends); its repair controller stays off, so the broken pods stay so.
	agenttest.Start(t, agenttest.Options{Args: []string{"--repair=false"}})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	start := time.Now()
	if err := tb.CreateNamespace(ctx, inspectNS); err != nil && !strings.Contains(err.Error(), "already exists") {
		t.Fatal(err)
	}
	elsewhere := echoPod("elsewhere", true)
	elsewhere.Spec.NodeName = "node-b" // bound to a node that does not exist: never started
	pods := []*corev1.Pod{echoPod("meshed", true), echoPod("plain", false), echoPod("broken", true), echoPod("plain-ruled", false), elsewhere}
	running := map[string]*corev1.Pod{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	errs := make(chan error, len(pods))
	for _, p := range pods {
		t.Cleanup(func() { _ = tb.DeletePod(context.Background(), inspectNS, p.Name) })
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := tb.CreatePod(ctx, p); err != nil {
				errs <- err
				return
			}
			if p.Spec.NodeName != "" {
				return
			}
			got, err := tb.WaitPodRunning(ctx, inspectNS, p.Name)
			if err != nil {
				errs <- err
				return
			}
			mu.Lock()
			running[p.Name] = got
			mu.Unlock()
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	t.Logf("%d pods running in %s", len(running), time.Since(start).Round(time.Millisecond))

	netnsOf := func(name string) string {
		p, err := tb.PodNetns(ctx, inspectNS, name)
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	breakRules(t, netnsOf("broken"))
	s := spec.PodDefaults()
	if _, err := engine.Apply(ctx, engine.Options{NetnsPath: netnsOf("plain-ruled")}, &s); err != nil {
		t.Fatal(err)
	}

	// --cni-conf-dir: the decision uses the plugin's entry the agent wrote there.
	common := []string{"--kubeconfig", tb.Kubeconfig(), "--netns-dir", testbedNetnsDir, "--node-name", testbed.NodeName, "--cni-conf-dir", testbed.CNIConfDir}
	configLine := "config:   meshcni entry of " + filepath.Join(testbed.CNIConfDir, testbed.DefaultConflistName)
	// The agent runs without --ebpf-acceleration; inspect finds its socket through the
	// entry's cni_agent_run_dir.
	agentOff := "ebpf:     not accelerated; the agent has not loaded eBPF acceleration: off"
	for _, tc := range []struct {
		pod      string
		extra    []string
		wantCode int
		want     []string
	}{
		{"meshed", nil, 0, []string{"decision: redirected", configLine, "exclude 5432", "live:     nftables", "redirect to :15006", "drift:    none", agentOff, "result:   in sync"}},
		{"plain", nil, 0, []string{"decision: not redirected", "reason:   no istio-proxy container", "live:     no meshcni rules", "result:   not meshed"}},
		{"broken", nil, exitDrift, []string{"decision: redirected", "drift:\n  missing:", "istio-inbound", "result:   DRIFT"}},
		{"plain-ruled", nil, exitDrift, []string{"decision: not redirected", "live:     nftables", "result:   UNEXPECTED RULES: the pod is not meshed but nftables holds meshcni rules"}},
		{"elsewhere", nil, exitUsage, []string{"pod inspect-e2e/elsewhere runs on node node-b, this is node meshcni-testbed"}},
		{"missing", nil, exitUsage, []string{"get pod inspect-e2e/missing", `pods "missing" not found`}},
		// Without the test bed's dir, the netns is still found through /proc (the
		// pod's processes); -n instead of namespace/name.
		{"meshed", []string{"--netns-dir", "/nonexistent", "-n", inspectNS}, 0, []string{"netns:    /proc/", "result:   in sync"}},
	} {
		t.Run(tc.pod, func(t *testing.T) {
			args := append([]string{"inspect"}, common...)
			ref := inspectNS + "/" + tc.pod
			if tc.extra != nil {
				args = append([]string{"inspect", "--kubeconfig", tb.Kubeconfig(), "--node-name", testbed.NodeName}, tc.extra...)
				ref = tc.pod
			}
			out, code, err := ctl(t, append(args, ref)...)
			text := out
			if err != nil {
				text += "\nerror: " + err.Error()
			}
			if code != tc.wantCode {
				t.Fatalf("exit %d, want %d:\n%s", code, tc.wantCode, text)
			}
			for _, w := range tc.want {
				if !strings.Contains(text, w) {
					t.Errorf("output lacks %q:\n%s", w, text)
				}
			}
			t.Logf("meshcnictl %s %s (exit %d):\n%s", strings.Join(args, " "), ref, code, text)
		})
	}

	t.Run("json drift", func(t *testing.T) {
		out, code, _ := ctl(t, append(append([]string{"inspect"}, common...), "-o", "json", inspectNS+"/broken")...)
		t.Logf("inspect -o json %s/broken (exit %d):\n%s", inspectNS, code, out)
		var r inspectReport
		if err := json.Unmarshal([]byte(out), &r); err != nil {
			t.Fatalf("json: %v\n%s", err, out)
		}
		if code != exitDrift || r.Status != statusDrift || r.Meshed == nil || !*r.Meshed || r.Drift == nil || len(r.Drift.Missing) == 0 ||
			r.Pod != inspectNS+"/broken" || r.Node != testbed.NodeName || r.PluginConfig != filepath.Join(testbed.CNIConfDir, testbed.DefaultConflistName) || !strings.HasPrefix(r.Netns, testbedNetnsDir) || r.Live[backend.Nftables] == "" || r.EBPF != ebpfNotAccelerated {
			t.Fatalf("exit %d, report %+v", code, r)
		}
		for _, m := range r.Drift.Missing {
			if !strings.Contains(m, "istio-inbound") {
				t.Errorf("missing rule outside the flushed chain: %s", m)
			}
		}
	})

	t.Run("netns path", func(t *testing.T) {
		ns := netnsOf("meshed")
		out, code, err := ctl(t, "inspect", ns)
		if code != 0 || err != nil || !strings.Contains(out, "live:     nftables") || !strings.Contains(out, "result:   live rules only") {
			t.Fatalf("exit %d, %v:\n%s", code, err, out)
		}
		// --netns with a pod compares that namespace with the pod: the plain pod's
		// empty namespace against the meshed pod's annotations is drift.
		out, code, _ = ctl(t, "inspect", "--kubeconfig", tb.Kubeconfig(), "--netns", netnsOf("plain"), inspectNS+"/meshed")
		if code != exitDrift || !strings.Contains(out, "live:     no meshcni rules") {
			t.Fatalf("exit %d:\n%s", code, out)
		}
	})

	t.Run("ambiguous", func(t *testing.T) {
		// A second namespace holding the meshed pod's IP (a stale one): inspect names
		// both and refuses to choose; --netns settles it.
		ip := running["meshed"].Status.PodIP
		dir := t.TempDir()
		stale := bindNetns(t, dir, "cni-stale", staleNetns(t, ip))
		args := append(append([]string{"inspect"}, common...), "--netns-dir", dir, inspectNS+"/meshed")
		out, code, err := ctl(t, args...)
		text := out
		if err != nil {
			text += "\nerror: " + err.Error()
		}
		for _, w := range []string{"several network namespaces hold the pod's addresses (" + ip + ")", stale + " holds " + ip, testbedNetnsDir + "/cni-", "give the pod's netns with --netns"} {
			if !strings.Contains(text, w) {
				t.Errorf("output lacks %q", w)
			}
		}
		if code != exitUsage {
			t.Fatalf("exit %d, want %d:\n%s", code, exitUsage, text)
		}
		t.Logf("meshcnictl %s (exit %d):\n%s", strings.Join(args, " "), code, text)
		out, code, _ = ctl(t, "inspect", "--kubeconfig", tb.Kubeconfig(), "--netns", netnsOf("meshed"), inspectNS+"/meshed")
		if code != 0 || !strings.Contains(out, "result:   in sync") {
			t.Fatalf("with --netns: exit %d:\n%s", code, out)
		}
	})

	// explain from the API says the same decisions for the same pods.
	testExplainAPI(t, tb.Kubeconfig(), inspectNS)
	t.Logf("wall time %s", time.Since(start).Round(time.Millisecond))
}

// staleNetns makes a netns holding ip on eth0 (a veth pair with both ends inside).
func staleNetns(t *testing.T, ip string) string {
	t.Helper()
	addr, err := netlink.ParseAddr(ip + "/32")
	if err != nil {
		t.Fatal(err)
	}
	path := testutil.NewNetns(t)
	err = netnsutil.Do(path, func() error {
		link := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "eth0"}, PeerName: "peer0"}
		if err := netlink.LinkAdd(link); err != nil {
			return err
		}
		if err := netlink.LinkSetUp(link); err != nil {
			return err
		}
		return netlink.AddrAdd(link, addr)
	})
	if err != nil {
		t.Fatalf("netns with %s: %v", ip, err)
	}
	return path
}

// bindNetns bind-mounts the namespace file src at dir/name, as a runtime does.
func bindNetns(t *testing.T, dir, name, src string) string {
	t.Helper()
	dst := filepath.Join(dir, name)
	if err := os.WriteFile(dst, nil, 0o444); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(src, dst, "none", unix.MS_BIND, ""); err != nil {
		t.Fatalf("bind %s at %s: %v", src, dst, err)
	}
	t.Cleanup(func() { _ = unix.Unmount(dst, unix.MNT_DETACH) })
	return dst
}
