package testbed

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/vishvananda/netlink"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// requireOwnTestbed: the lifecycle tests start and stop their own test bed, so they
// need root, the binaries, and no test bed run by someone else.
func requireOwnTestbed(t testing.TB) Binaries {
	t.Helper()
	testutil.RequireRoot(t)
	b, err := Lookup()
	if err != nil {
		if errors.Is(err, ErrNotBuilt) {
			testutil.Missing(t, "%v", err)
		}
		t.Fatal(err)
	}
	if _, pid, ok := Running(); ok {
		testutil.Missing(t, "a test bed owned by pid %d is running (hack/testbed up); these tests stop and start their own: run hack/testbed down", pid)
	}
	return b
}

func start(t *testing.T, opts Options) *Testbed {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	began := time.Now()
	tb, err := Start(ctx, opts)
	if err != nil {
		t.Fatalf("start: %v", err)
	}
	t.Logf("started (%s) in %s (%s after getting the lock)", tb.Mode, time.Since(began).Round(time.Millisecond), tb.StartupTime.Round(time.Millisecond))
	t.Cleanup(func() { _ = tb.Stop(context.Background()) })
	return tb
}

func stopClean(t *testing.T, tb *Testbed) {
	t.Helper()
	began := time.Now()
	if err := tb.Stop(context.Background()); err != nil {
		t.Fatalf("stop: %v", err)
	}
	t.Logf("stopped in %s", time.Since(began).Round(time.Millisecond))
	if left := Leftovers(); len(left) > 0 {
		t.Fatalf("stop left behind: %v", left)
	}
}

// TestSmokeFullNode is the proof that the test bed is a real node: a pod with a
// locally built image goes Ready through bridge + host-local + portmap (+
// loopback), is reachable from the host over TCP (pod IP and hostPort), logs and
// exec work through the API server, the pod's netns is found and entered, a
// DaemonSet rolls out, and Stop leaves nothing behind. Then it does it all again,
// proving two runs in a row do not interfere.
func TestSmokeFullNode(t *testing.T) {
	requireOwnTestbed(t)
	for round := 1; round <= 2; round++ {
		t.Run("round"+strconv.Itoa(round), func(t *testing.T) {
			before := hostState(t)
			tb := start(t, Options{})
			if !isBPFFS(HostBPFFS) {
				t.Errorf("no bpffs at %s while the test bed runs (a node has one)", HostBPFFS)
			}
			smoke(t, tb)
			stopClean(t, tb)
			if after := hostState(t); after != before {
				t.Errorf("the host after Stop: %s, before Start: %s", after, before)
			}
		})
		if t.Failed() {
			return
		}
	}
}

// hostState is what the test bed changes on the host while it runs and must put
// back: whether HostBPFFS is a bpffs, and the forwarding sysctls.
func hostState(t *testing.T) string {
	t.Helper()
	st := fmt.Sprintf("bpffs at %s: %v", HostBPFFS, isBPFFS(HostBPFFS))
	for _, p := range hostSysctls {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		st += fmt.Sprintf(", %s=%s", filepath.Base(filepath.Dir(p))+"/"+filepath.Base(p), strings.TrimSpace(string(b)))
	}
	return st
}

func smoke(t *testing.T, tb *Testbed) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	// The CNI dirs are the test bed's own and hold the default chain.
	conf, err := os.ReadFile(CNIConfDir + "/" + DefaultConflistName)
	if err != nil || !strings.Contains(string(conf), `"portmap"`) || !strings.Contains(string(conf), BridgeName) {
		t.Fatalf("conflist %s: %v", conf, err)
	}
	for _, p := range []string{"bridge", "host-local", "loopback", "portmap"} {
		if _, err := os.Stat(CNIBinDir + "/" + p); err != nil {
			t.Fatalf("plugin %s: %v", p, err)
		}
	}

	const hostPort = 18080
	began := time.Now()
	if _, err := tb.CreatePod(ctx, EchoPod("echo", hostPort)); err != nil {
		t.Fatal(err)
	}
	pod, err := tb.WaitPodReady(ctx, "default", "echo")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("pod Ready in %s, ip %s", time.Since(began).Round(time.Millisecond), pod.Status.PodIP)
	if ip := net.ParseIP(pod.Status.PodIP); ip == nil || !mustCIDR(PodCIDR).Contains(ip) {
		t.Fatalf("pod IP %q not in %s", pod.Status.PodIP, PodCIDR)
	}

	// TCP from the host: to the pod IP, and through portmap's hostPort on NodeIP.
	for _, addr := range []string{net.JoinHostPort(pod.Status.PodIP, strconv.Itoa(EchoPort)), net.JoinHostPort(NodeIP, strconv.Itoa(hostPort))} {
		line, err := echoRoundTrip(addr)
		if err != nil {
			t.Fatalf("echo via %s: %v", addr, err)
		}
		if !strings.HasPrefix(line, "echo ") {
			t.Fatalf("echo via %s answered %q", addr, line)
		}
		t.Logf("%s answered %q", addr, line)
	}

	// Logs and exec through the API server and the kubelet.
	logs, err := tb.PodLogs(ctx, "default", "echo", "")
	if err != nil || !strings.Contains(logs, "echo server listening") {
		t.Fatalf("logs = %q, %v", logs, err)
	}
	out, _, err := tb.Exec(ctx, "default", "echo", "echo", "/echo", "hostname")
	if err != nil || strings.TrimSpace(out) != "echo" {
		t.Fatalf("exec hostname = %q, %v", out, err)
	}
	if _, _, err := tb.Exec(ctx, "default", "echo", "echo", "/echo", "cat", "/nonexistent"); err == nil {
		t.Fatal("exec of a failing command succeeded")
	}

	// The pod's network namespace: eth0 holds the pod IP, lo is up (loopback plugin).
	path, err := tb.PodNetns(ctx, "default", "echo")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("pod netns %s", path)
	err = tb.InPodNetns(ctx, "default", "echo", func() error {
		eth0, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		addrs, err := netlink.AddrList(eth0, netlink.FAMILY_V4)
		if err != nil {
			return err
		}
		found := false
		for _, a := range addrs {
			found = found || a.IP.String() == pod.Status.PodIP
		}
		if !found {
			return fmt.Errorf("eth0 addresses %v lack %s", addrs, pod.Status.PodIP)
		}
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return err
		}
		if lo.Attrs().Flags&net.FlagUp == 0 {
			return errors.New("lo is down")
		}
		// A connection from inside the pod to its own server.
		_, err = echoRoundTrip(net.JoinHostPort("127.0.0.1", strconv.Itoa(EchoPort)))
		return err
	})
	if err != nil {
		t.Fatalf("in pod netns: %v", err)
	}

	// A DaemonSet rolls out (controller-manager + scheduler + kubelet).
	began = time.Now()
	ds := &appsv1.DaemonSet{
		ObjectMeta: metav1.ObjectMeta{Name: "echo-ds", Namespace: "default"},
		Spec: appsv1.DaemonSetSpec{
			Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "echo-ds"}},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"app": "echo-ds"}},
				Spec:       EchoPod("x", 0).Spec,
			},
		},
	}
	if _, err := tb.Client.AppsV1().DaemonSets("default").Create(ctx, ds, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := tb.WaitDaemonSet(ctx, "default", "echo-ds"); err != nil {
		t.Fatal(err)
	}
	t.Logf("daemonset rolled out in %s", time.Since(began).Round(time.Millisecond))

	// A projected ServiceAccount token is mounted (default SA and kube-root-ca.crt exist).
	out, _, err = tb.Exec(ctx, "default", "echo", "echo", "/echo", "cat", "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt")
	if err != nil || !strings.Contains(out, "BEGIN CERTIFICATE") {
		t.Fatalf("service account ca.crt = %q, %v", out, err)
	}
}

func echoRoundTrip(addr string) (string, error) {
	c, err := net.DialTimeout("tcp", addr, 3*time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(3 * time.Second))
	r := bufio.NewReader(c)
	line, err := r.ReadString('\n')
	if err != nil {
		return "", err
	}
	if _, err := fmt.Fprintf(c, "ping\n"); err != nil {
		return "", err
	}
	if back, err := r.ReadString('\n'); err != nil || back != "ping\n" {
		return "", fmt.Errorf("echo back %q, %v", back, err)
	}
	return strings.TrimSpace(line), nil
}

func mustCIDR(s string) *net.IPNet {
	_, n, err := net.ParseCIDR(s)
	if err != nil {
		panic(err)
	}
	return n
}

// TestAPIOnly proves the etcd + kube-apiserver mode starts from the cache, serves the
// API and runs nothing else. How fast it starts is BenchmarkStart's figure.
func TestAPIOnly(t *testing.T) {
	requireOwnTestbed(t)
	tb := start(t, Options{APIOnly: true})
	ctx := context.Background()
	v, err := tb.Client.Discovery().ServerVersion()
	if err != nil || v.GitVersion != KubernetesVersion {
		t.Fatalf("server version %v, %v", v, err)
	}
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "x", Namespace: "default"}, Data: map[string]string{"k": "v"}}
	if _, err := tb.Client.CoreV1().ConfigMaps("default").Create(ctx, cm, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if ps := ourProcesses(); len(ps) != 2 {
		t.Errorf("api-only runs %v, want etcd and kube-apiserver", describe(ps))
	}
	stopClean(t, tb)
}

// BenchmarkStart measures Start (from the lock to the test bed ready: api-only,
// etcd and kube-apiserver serving; full, the node Ready with its default
// ServiceAccount and images imported) and Stop, once per iteration, from the cache.
// Reported: start-ms and stop-ms (medians); ns/op is the whole round.
func BenchmarkStart(b *testing.B) {
	requireOwnTestbed(b)
	for _, c := range []struct {
		name string
		opts Options
	}{{"api-only", Options{APIOnly: true}}, {"full", Options{}}} {
		b.Run(c.name, func(b *testing.B) {
			var starts, stops []time.Duration
			for b.Loop() {
				ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
				tb, err := Start(ctx, c.opts)
				cancel()
				if err != nil {
					b.Fatalf("start: %v", err)
				}
				began := time.Now()
				if err := tb.Stop(context.Background()); err != nil {
					b.Fatalf("stop: %v", err)
				}
				starts, stops = append(starts, tb.StartupTime), append(stops, time.Since(began))
			}
			if left := Leftovers(); len(left) > 0 {
				b.Fatalf("stop left behind: %v", left)
			}
			b.ReportMetric(medianMs(starts), "start-ms")
			b.ReportMetric(medianMs(stops), "stop-ms")
		})
	}
}

func medianMs(ds []time.Duration) float64 {
	slices.Sort(ds)
	return float64(ds[len(ds)/2].Microseconds()) / 1000
}

// TestDownIsIdempotent: Down with nothing running succeeds and leaves nothing.
func TestDownIsIdempotent(t *testing.T) {
	requireOwnTestbed(t)
	// Wait for other test binaries using the test bed (Down refuses to stop them).
	deadline := time.Now().Add(5 * time.Minute)
	for {
		if _, _, busy := Busy(); !busy {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the test bed stayed busy for 5 minutes")
		}
		time.Sleep(time.Second)
	}
	for range 2 {
		if err := Down(context.Background(), nil, false); err != nil {
			t.Fatal(err)
		}
	}
	if left := Leftovers(); len(left) > 0 {
		t.Fatalf("left: %v", left)
	}
}

func TestConflist(t *testing.T) {
	plugins := append(DefaultPlugins(), map[string]any{"type": "meshcni"})
	b, err := Conflist(plugins)
	if err != nil {
		t.Fatal(err)
	}
	s := string(b)
	for _, want := range []string{`"cniVersion": "1.0.0"`, `"type": "bridge"`, `"type": "host-local"`, `"type": "portmap"`, `"type": "meshcni"`, PodCIDR, BridgeName} {
		if !strings.Contains(s, want) {
			t.Errorf("conflist lacks %s:\n%s", want, s)
		}
	}
}

// TestShared: Shared starts one full test bed and returns it again; without
// RunMain it stops when the test that started it ends.
func TestShared(t *testing.T) {
	requireOwnTestbed(t)
	var first *Testbed
	t.Run("start", func(t *testing.T) {
		first = Shared(t)
		if first.Mode != ModeFull || !first.Owned() {
			t.Fatalf("mode %s owned %v", first.Mode, first.Owned())
		}
	})
	if first == nil || t.Failed() {
		return
	}
	// The subtest's cleanup stopped it: Shared starts a fresh one for this test.
	if Leftovers() != nil {
		t.Fatalf("shared test bed not stopped after its test: %v", Leftovers())
	}
	tb := Shared(t)
	if tb2 := Shared(t); tb2 != tb {
		t.Fatal("Shared returned a different test bed")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := tb.CreateNamespace(ctx, "shared-test"); err != nil {
		t.Fatal(err)
	}
	p := EchoPod("echo", 0)
	p.Namespace = "shared-test"
	if _, err := tb.CreatePod(ctx, p); err != nil {
		t.Fatal(err)
	}
	if _, err := tb.WaitPodReady(ctx, "shared-test", "echo"); err != nil {
		t.Fatal(err)
	}
}

// TestDownAfterCrash: the owner of a full test bed with a running pod is killed
// (SIGKILL, no Stop); Down then removes every trace and a new Start works.
func TestDownAfterCrash(t *testing.T) { crashThenDown(t, 1) }

// TestDownAfterCrashWithNodes is TestDownAfterCrash with a second node running a
// pod: Down finds and removes the extra node's processes, namespaces, veth,
// cgroups and directories too.
func TestDownAfterCrashWithNodes(t *testing.T) { crashThenDown(t, 2) }

func crashThenDown(t *testing.T, nodes int) {
	if n, err := strconv.Atoi(os.Getenv("MESHCNI_TESTBED_CRASH_CHILD")); err == nil {
		crashChild(t, n)
		return
	}
	requireOwnTestbed(t)
	startReaper() // the orphans are re-parented to this process and reaped
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(self, "-test.run=^"+t.Name()+"$", "-test.v")
	cmd.Env = append(os.Environ(), "MESHCNI_TESTBED_CRASH_CHILD="+strconv.Itoa(nodes))
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}()
	deadline := time.Now().Add(3 * time.Minute)
	for {
		if b, err := os.ReadFile(RunDir + "/crash-child-ready"); err == nil && string(b) == strconv.Itoa(cmd.Process.Pid) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("child never got ready:\n%s", out.String())
		}
		time.Sleep(200 * time.Millisecond)
	}
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	if len(ourProcesses()) == 0 {
		t.Fatal("expected orphaned test bed processes after the crash")
	}
	if err := Down(context.Background(), nil, false); err != nil {
		t.Fatalf("down after crash: %v", err)
	}
	if left := Leftovers(); len(left) > 0 {
		t.Fatalf("down after crash left: %v", left)
	}
	tb := start(t, Options{APIOnly: true})
	stopClean(t, tb)
}

func crashChild(t *testing.T, nodes int) {
	ctx := context.Background()
	tb, err := Start(ctx, Options{Nodes: nodes})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tb.CreatePod(ctx, EchoPod("crash", 18081)); err != nil {
		t.Fatal(err)
	}
	if _, err := tb.WaitPodReady(ctx, "default", "crash"); err != nil {
		t.Fatal(err)
	}
	for i, n := range tb.Nodes()[1:] {
		name := "crash-" + strconv.Itoa(i+2)
		if _, err := tb.CreatePod(ctx, nodeEchoPod(name, n.Name)); err != nil {
			t.Fatal(err)
		}
		if _, err := tb.WaitPodReady(ctx, "default", name); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(RunDir+"/crash-child-ready", []byte(strconv.Itoa(os.Getpid())), 0o644); err != nil {
		t.Fatal(err)
	}
	time.Sleep(10 * time.Minute) // killed by the parent
}
