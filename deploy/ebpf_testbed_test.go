package deploy_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/standin/proxysim"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/internal/testkit/traffic"
	"github.com/meshcni/meshcni/internal/tools/build/image"
	"github.com/meshcni/meshcni/pkg/capture"
)

const (
	// ebpfNamespace holds TestHelmEBPF's meshed pods.
	ebpfNamespace = "meshcni-ebpf"
	// ebpfPins is the chart's pin directory (the agent's default --ebpf-pin-dir) and
	// its parent, both on the node's bpffs.
	ebpfPins    = "/sys/fs/bpf/meshcni/sockmap"
	ebpfPinRoot = "/sys/fs/bpf/meshcni"
)

// ebpfDst is an outbound destination of the meshed pods: captured to 15001, where
// the stand-in proxy (record mode) answers with the original destination it read.
var ebpfDst = netip.MustParseAddrPort("10.96.77.7:80")

// TestHelmEBPF installs the chart with ebpf.enabled=true on a full test bed: the agent
// container, under seccomp RuntimeDefault with the capabilities the chart gives it
// (BPF and PERFMON added, no privileged), loads the programs into the node's
// /sys/fs/bpf through its hostPath and attaches sockops to the node's cgroup2 root
// (ebpf.cgroup2 left at its default, /sys/fs/cgroup: on a cgroup v1 hybrid node such
// as this machine the agent finds cgroup2 at its unified/). Of two meshed pods, the one annotated
// meshcni.io/ebpf-acceleration=to-proxy is accelerated and the other is not: real
// bytes the app sends to its proxy (UID 1337, reading SO_ORIGINAL_DST) in each pod's
// network namespace move meshcni_ebpf_redirected_bytes_total, scraped from the agent
// pod, for the first only, and `meshcnictl inspect` says accelerated for one and not
// accelerated for the other. helm uninstall removes the programs, maps and pins.
// First, on the same node with its /sys/fs/bpf covered (no bpffs there), the agent
// reports the acceleration unavailable and why, and loads nothing.
func TestHelmEBPF(t *testing.T) {
	testutil.RequireRoot(t)
	if _, err := testbed.Lookup(); err != nil {
		if errors.Is(err, testbed.ErrNotBuilt) {
			testutil.Missing(t, "%v", err)
		}
		t.Fatal(err)
	}
	helm := helmBinary(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	root, err := testbed.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	img := builtImage(ctx, t, root)
	meshcnictl := filepath.Join(root, "bin", "images", "build", strings.ReplaceAll(image.HostArch().String(), "/", "-"), "meshcnictl")
	tb, err := testbed.Start(ctx, testbed.Options{ImageArchives: []string{img.Out}})
	if errors.Is(err, testbed.ErrRunning) {
		testutil.Missing(t, "a shared test bed is running (hack/testbed up): stop it to run this test")
	}
	if err != nil {
		t.Fatalf("test bed: %v", err)
	}
	t.Cleanup(func() { _ = tb.Stop(context.Background()) })
	createNamespace(ctx, t, tb, installNamespace)
	createNamespace(ctx, t, tb, ebpfNamespace)
	if _, err := os.Stat(ebpfPinRoot); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("%s exists before install (stat: %v): another agent's acceleration is loaded on this machine", ebpfPinRoot, err)
	}
	bpfBefore := liveBPF(t)

	helmRun := func(args ...string) {
		t.Helper()
		cmd := exec.CommandContext(ctx, helm, args...)
		cmd.Env = append(helmEnv(helmHome), "KUBECONFIG="+tb.Kubeconfig())
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("helm %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	install := func() {
		t.Helper()
		helmRun("install", release, chartDir, "--namespace", installNamespace, "--values", "testbed-values.yaml",
			"--set", "ebpf.enabled=true", "--set", "taintController.enabled=false")
		wctx, wcancel := context.WithTimeout(ctx, 2*time.Minute)
		defer wcancel()
		if _, err := tb.WaitDaemonSet(wctx, installNamespace, "meshcni-agent"); err != nil {
			t.Fatalf("agent: %v\n%s", err, diagnose(ctx, tb))
		}
	}
	uninstall := func() {
		t.Helper()
		helmRun("uninstall", release, "--namespace", installNamespace, "--wait")
		if err := poll(ctx, time.Minute, func() error {
			if n := agentPodNames(ctx, t, tb); len(n) > 0 {
				return fmt.Errorf("agent pods left: %v", n)
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
	}

	// A node whose /sys/fs/bpf is not a bpffs (an empty tmpfs over the test bed's,
	// as a host without one shows the agent an empty directory): acceleration is
	// unavailable and says why; no pin is made, nor any program loaded behind a
	// bpffs of the agent container's own.
	unshadow := shadowBPFFS(t)
	install()
	if v := metricValue(t, agentMetrics(t), "meshcni_ebpf_available"); v != 0 {
		t.Errorf("without a bpffs on the node: meshcni_ebpf_available %v, want 0", v)
	}
	if r := agentReadyz(t); !strings.Contains(r, "is not on a bpffs") {
		t.Errorf("without a bpffs on the node: /readyz %q does not say the pin directory is not on a bpffs", r)
	}
	if left := newBPF(liveBPF(t), bpfBefore); len(left) > 0 {
		t.Errorf("without a bpffs on the node: meshcni's programs or maps loaded anyway (pinned where the node cannot see them): %v", left)
	}
	if ents, err := os.ReadDir(ebpfShadow); err != nil || len(ents) > 0 {
		t.Errorf("without a bpffs on the node: %s holds %v (err %v), want nothing", ebpfShadow, ents, err)
	}
	uninstall()
	unshadow()

	install()
	checkEBPFAgent(t)
	if v := metricValue(t, agentMetrics(t), "meshcni_ebpf_available"); v != 1 {
		t.Fatalf("meshcni_ebpf_available %v, want 1; the agent's /readyz: %s", v, agentReadyz(t))
	}
	for _, n := range []string{"allow", "socks", "targets", "peer", "stats", "sockops", "skmsg", "sockops_link"} {
		if _, err := os.Stat(filepath.Join(ebpfPins, n)); err != nil {
			t.Errorf("pin %s on the node: %v", n, err)
		}
	}

	fast := startEBPFPod(ctx, t, tb, "ebpf-fast", capture.AccelToProxy)
	plain := startEBPFPod(ctx, t, tb, "ebpf-plain", capture.AccelDefault)
	for pod, want := range map[string]string{"ebpf-fast": "accelerated", "ebpf-plain": "not accelerated"} {
		if got := inspectEBPF(ctx, t, meshcnictl, pod); got != want {
			t.Errorf("meshcnictl inspect %s/%s: ebpf %q, want %q", ebpfNamespace, pod, got, want)
		}
	}
	const n = 32 << 10
	redirected := func() float64 { return metricValue(t, agentMetrics(t), "meshcni_ebpf_redirected_bytes_total") }
	before := redirected()
	appToProxy(t, plain, n)
	if got := redirected(); got != before {
		t.Errorf("ebpf-plain (not opted in): redirected bytes %v → %v, want unchanged", before, got)
	}
	appToProxy(t, fast, n)
	after := redirected()
	if after-before < n {
		t.Errorf("ebpf-fast: redirected bytes %v → %v, want ≥ %d more", before, after, n)
	}
	t.Logf("ebpf-fast: %v bytes redirected by sk_msg for %d sent; ebpf-plain: 0", after-before, n)

	for _, p := range []string{"ebpf-fast", "ebpf-plain"} {
		if err := tb.DeletePod(ctx, ebpfNamespace, p); err != nil {
			t.Fatal(err)
		}
	}
	uninstall()
	if _, err := os.Stat(ebpfPinRoot); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s left on the node's bpffs after helm uninstall (stat: %v)", ebpfPinRoot, err)
	}
	// The kernel frees programs and maps once the last reference (pins, link, fds) is gone.
	if err := poll(ctx, 30*time.Second, func() error {
		if left := newBPF(liveBPF(t), bpfBefore); len(left) > 0 {
			return fmt.Errorf("meshcni's programs or maps still loaded: %v", left)
		}
		return nil
	}); err != nil {
		t.Errorf("after helm uninstall: %v", err)
	}
}

// ebpfShadow is the node's bpffs directory, which shadowBPFFS covers.
const ebpfShadow = "/sys/fs/bpf"

// shadowBPFFS mounts an empty tmpfs over the node's /sys/fs/bpf, so that a container
// started meanwhile sees no bpffs there (the node's own stays intact beneath), and
// returns the func that removes it (also run at the test's end).
func shadowBPFFS(t *testing.T) func() {
	t.Helper()
	if err := unix.Mount("tmpfs", ebpfShadow, "tmpfs", 0, "size=1m,mode=0700"); err != nil {
		t.Fatalf("cover %s with a tmpfs: %v", ebpfShadow, err)
	}
	done := false
	remove := func() {
		if done {
			return
		}
		done = true
		if err := unix.Unmount(ebpfShadow, unix.MNT_DETACH); err != nil {
			t.Errorf("remove the tmpfs over %s: %v", ebpfShadow, err)
		}
	}
	t.Cleanup(remove)
	return remove
}

// checkEBPFAgent: the agent container runs under a seccomp filter (RuntimeDefault),
// not privileged, with CAP_BPF and CAP_PERFMON in its effective set.
func checkEBPFAgent(t *testing.T) {
	t.Helper()
	if sc := agentSeccomp(t); len(sc) != 1 || sc[0] != "2" {
		t.Errorf("meshcni-agent processes' Seccomp modes %v, want one, 2 (filter)", sc)
	}
	eff := agentCapEff(t)
	for _, c := range []struct {
		name string
		bit  uint
	}{{"CAP_BPF", unix.CAP_BPF}, {"CAP_PERFMON", unix.CAP_PERFMON}, {"CAP_NET_ADMIN", unix.CAP_NET_ADMIN}, {"CAP_SYS_ADMIN", unix.CAP_SYS_ADMIN}} {
		if eff&(1<<c.bit) == 0 {
			t.Errorf("meshcni-agent's effective capabilities %#x lack %s", eff, c.name)
		}
	}
	if full := uint64(1)<<(unix.CAP_LAST_CAP+1) - 1; eff == full {
		t.Errorf("meshcni-agent runs with every capability (%#x): privileged", eff)
	}
}

// agentCapEff is the CapEff of the one meshcni-agent process on the node.
func agentCapEff(t *testing.T) uint64 {
	t.Helper()
	effs := agentStatus(t, "CapEff:")
	if len(effs) != 1 {
		t.Fatalf("%d meshcni-agent processes on the node, want 1", len(effs))
	}
	e, err := strconv.ParseUint(effs[0], 16, 64)
	if err != nil {
		t.Fatalf("meshcni-agent CapEff %q: %v", effs[0], err)
	}
	return e
}

// agentReadyz is the body of the agent's /readyz on the node's IP (its eBPF line
// says why acceleration is unavailable).
func agentReadyz(t *testing.T) string {
	t.Helper()
	resp, err := http.Get("http://" + testbed.NodeIP + ":9807/readyz")
	if err != nil {
		return err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.Status + " " + string(b)
}

// metricValue is the value of an unlabelled sample in a Prometheus text exposition.
func metricValue(t *testing.T, text, name string) float64 {
	t.Helper()
	for _, l := range strings.Split(text, "\n") {
		if v, ok := strings.CutPrefix(l, name+" "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err != nil {
				t.Fatalf("%s: %v", l, err)
			}
			return f
		}
	}
	t.Fatalf("no sample %s in the agent's metrics:\n%s", name, grepLines(text, "meshcni_ebpf"))
	return 0
}

// startEBPFPod runs a meshed pod (the plugin writes its redirect) with the
// acceleration annotation (AccelDefault: none) and returns its network namespace.
func startEBPFPod(ctx context.Context, t *testing.T, tb *testbed.Testbed, name string, a capture.Acceleration) string {
	t.Helper()
	p := meshedPod(name)
	p.Namespace = ebpfNamespace
	if a != capture.AccelDefault {
		p.Annotations[capture.AnnotationEBPFAcceleration] = string(a)
	}
	if _, err := tb.CreatePod(ctx, p); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tb.DeletePod(context.Background(), ebpfNamespace, name) })
	if _, err := tb.WaitPodRunning(ctx, ebpfNamespace, name); err != nil {
		t.Fatalf("%v\n%s", err, diagnose(ctx, tb))
	}
	netns, err := tb.PodNetns(ctx, ebpfNamespace, name)
	if err != nil {
		t.Fatal(err)
	}
	return netns
}

// appToProxy runs the stand-in proxy in the pod (UID 1337, record mode) and, as the
// app, sends n bytes to ebpfDst: the redirect takes them to the proxy, which answers
// with the original destination it read (SO_ORIGINAL_DST).
func appToProxy(t *testing.T, netns string, n int) {
	t.Helper()
	traffic.StartProxy(t, netns, traffic.ProxyOptions{Args: []string{"--log-level=error"}})
	rec := traffic.SendBulk(t, netns, ebpfDst, n)
	if rec.Listener != proxysim.ListenerOutbound || rec.OrigDst != ebpfDst {
		t.Fatalf("proxy saw listener %s, original destination %v; want %s, %v", rec.Listener, rec.OrigDst, proxysim.ListenerOutbound, ebpfDst)
	}
}

// inspectEBPF runs `meshcnictl inspect -o json` on the node, as an operator would,
// and returns its ebpf field.
func inspectEBPF(ctx context.Context, t *testing.T, meshcnictl, pod string) string {
	t.Helper()
	cmd := exec.CommandContext(ctx, meshcnictl, "inspect", "-o", "json", "--kubeconfig", testbed.KubeconfigPath(),
		"--node-name", testbed.NodeName, "--netns-dir", testbed.NetnsDir, ebpfNamespace+"/"+pod)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var ee *exec.ExitError
	if err != nil && !(errors.As(err, &ee) && ee.ExitCode() == 1) { // 1: drift, still a report
		t.Fatalf("meshcnictl inspect %s: %v: %s", pod, err, stderr.String())
	}
	var rep struct {
		EBPF       string `json:"ebpf"`
		EBPFReason string `json:"ebpfReason"`
	}
	if err := json.Unmarshal(stdout.Bytes(), &rep); err != nil {
		t.Fatalf("meshcnictl inspect %s: output %q: %v", pod, stdout.String(), err)
	}
	t.Logf("meshcnictl inspect %s: ebpf %q %s", pod, rep.EBPF, rep.EBPFReason)
	return rep.EBPF
}

// ebpfNames are the names meshcni's programs and maps carry in the kernel.
var ebpfNames = map[string]bool{"sockops": true, "skmsg": true, "allow": true, "socks": true, "targets": true, "peer": true, "stats": true}

// liveBPF lists the loaded programs and maps that carry one of meshcni's names, as
// "prog name#id" and "map name#id".
func liveBPF(t *testing.T) []string {
	t.Helper()
	var out []string
	for id, err := ebpf.ProgramGetNextID(0); ; id, err = ebpf.ProgramGetNextID(id) {
		if errors.Is(err, os.ErrNotExist) {
			break
		}
		if err != nil {
			t.Fatalf("walk BPF programs: %v", err)
		}
		p, err := ebpf.NewProgramFromID(id)
		if err != nil {
			continue // freed meanwhile
		}
		info, err := p.Info()
		p.Close()
		if err == nil && ebpfNames[info.Name] {
			out = append(out, fmt.Sprintf("prog %s#%d", info.Name, id))
		}
	}
	for id, err := ebpf.MapGetNextID(0); ; id, err = ebpf.MapGetNextID(id) {
		if errors.Is(err, os.ErrNotExist) {
			break
		}
		if err != nil {
			t.Fatalf("walk BPF maps: %v", err)
		}
		m, err := ebpf.NewMapFromID(id)
		if err != nil {
			continue
		}
		info, err := m.Info()
		m.Close()
		if err == nil && ebpfNames[info.Name] {
			out = append(out, fmt.Sprintf("map %s#%d", info.Name, id))
		}
	}
	return out
}

// newBPF is what is in now and not in before.
func newBPF(now, before []string) []string {
	var out []string
	for _, s := range now {
		if !slices.Contains(before, s) {
			out = append(out, s)
		}
	}
	return out
}
