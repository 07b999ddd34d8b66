package agent_test

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/standin/proxysim"
	"github.com/meshcni/meshcni/internal/testkit/agenttest"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/internal/testkit/traffic"
	"github.com/meshcni/meshcni/pkg/agentsock"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/ebpf/sockmap"
)

// ebpfDst is an outbound destination of the meshed pods: captured to 15001, where
// the stand-in proxy (record mode) answers with what it saw.
var ebpfDst = netip.MustParseAddrPort("10.96.77.7:80")

// TestEBPFOnTestbed: the agent binary with --ebpf-acceleration auto on the test
// bed's node. kubelet runs two meshed pods through the chain; the plugin reports
// each pod's netns cookie; the agent enables the one annotated
// meshcni.io/ebpf-acceleration=to-proxy and not the other (default off). Bytes the
// app sends to its proxy (UID 1337, reading SO_ORIGINAL_DST) are redirected by
// sk_msg in the annotated pod — the agent's meshcni_ebpf_redirected_bytes_total
// grows by at least what was sent — and not in the other one (the counter stays).
// The pod's DEL disables it; the agent's removal unloads the pins. Then an agent
// whose detection is forced to fail: ready, meshcni_ebpf_available 0, the reason in
// /readyz, and an annotated pod redirected as without acceleration.
func TestEBPFOnTestbed(t *testing.T) {
	tb := testbed.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	if err := tb.CreateNamespace(ctx, e2eNS); err != nil && !apierrors.IsAlreadyExists(err) && !strings.Contains(err.Error(), "already exists") {
		t.Fatal(err)
	}
	pins := filepath.Join(testutil.BPFFS(t), "meshcni-e2e")
	a := agenttest.Start(t, agenttest.Options{Args: []string{"--ebpf-acceleration", "auto", "--ebpf-pin-dir", pins, "--keep-on-exit=never"}})
	if v := value(t, a.Metrics(t), "meshcni_ebpf_available", nil); v != 1 {
		_, body, _ := a.Ready()
		t.Fatalf("meshcni_ebpf_available %v; /readyz %q", v, body)
	}

	fast := startMeshed(ctx, t, tb, "ebpf-fast", capture.AccelToProxy)
	plain := startMeshed(ctx, t, tb, "ebpf-plain", capture.AccelDefault)
	cookie, err := sockmap.NetnsCookie(fast)
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "the agent enabled ebpf-fast", func() error {
		for _, line := range strings.Split(a.Log(), "\n") {
			if strings.Contains(line, `"eBPF acceleration enabled"`) && strings.Contains(line, `"pod_name":"ebpf-fast"`) &&
				strings.Contains(line, fmt.Sprintf(`"netns_cookie":%d`, cookie)) {
				return nil
			}
		}
		return fmt.Errorf("no log line enabling ebpf-fast with cookie %d", cookie)
	})
	for _, line := range strings.Split(a.Log(), "\n") {
		if strings.Contains(line, `"eBPF acceleration enabled"`) && strings.Contains(line, `"pod_name":"ebpf-plain"`) {
			t.Fatalf("the agent enabled ebpf-plain: %s", line)
		}
	}
	if v := value(t, a.Metrics(t), "meshcni_ebpf_accelerated_pods", nil); v != 1 {
		t.Fatalf("meshcni_ebpf_accelerated_pods %v, want 1", v)
	}
	plainCookie, err := sockmap.NetnsCookie(plain)
	if err != nil {
		t.Fatal(err)
	}
	for c, want := range map[uint64]bool{cookie: true, plainCookie: false} {
		if got := askAgent(ctx, t, a.RunDir, c); !got.Available || got.Accelerated != want {
			t.Errorf("agent socket: netns cookie %d: %+v, want accelerated %v", c, got, want)
		}
	}

	const n = 32 << 10
	redirected := func() float64 { return value(t, a.Metrics(t), "meshcni_ebpf_redirected_bytes_total", nil) }
	before := redirected()
	sendToProxy(t, plain, n)
	if got := redirected(); got != before {
		t.Errorf("ebpf-plain (not opted in): redirected bytes %v → %v, want unchanged", before, got)
	}
	sendToProxy(t, fast, n)
	after := redirected()
	if after-before < n {
		t.Errorf("ebpf-fast: redirected bytes %v → %v, want ≥ %d more", before, after, n)
	}
	t.Logf("ebpf-fast: %v bytes redirected by sk_msg for %d sent; ebpf-plain: 0", after-before, n)

	if err := tb.DeletePod(ctx, e2eNS, "ebpf-fast"); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 60*time.Second, "ebpf-fast disabled after its DEL", func() error {
		if v := value(t, a.Metrics(t), "meshcni_ebpf_accelerated_pods", nil); v != 0 {
			return fmt.Errorf("meshcni_ebpf_accelerated_pods %v", v)
		}
		return nil
	})
	if err := a.Stop(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(pins); !os.IsNotExist(err) {
		t.Fatalf("pins %s left after the agent removed the plugin (stat: %v)", pins, err)
	}

	// Forced unavailable: pods are redirected as without acceleration.
	u := agenttest.Start(t, agenttest.Options{Args: []string{"--ebpf-acceleration", "auto", "--ebpf-pin-dir", pins,
		"--ebpf-force-unavailable", "test bed: simulated old kernel", "--keep-on-exit=never"}})
	if v := value(t, u.Metrics(t), "meshcni_ebpf_available", nil); v != 0 {
		t.Fatalf("meshcni_ebpf_available %v with detection forced to fail", v)
	}
	ready, body, err := u.Ready()
	if err != nil || !ready || !strings.Contains(body, "ebpf acceleration: unavailable: eBPF acceleration unavailable: forced by setting: test bed: simulated old kernel") {
		t.Fatalf("/readyz ready=%v err=%v body=%q", ready, err, body)
	}
	fallback := startMeshed(ctx, t, tb, "ebpf-fallback", capture.AccelBoth)
	sendToProxy(t, fallback, n)
	if _, err := os.Stat(pins); !os.IsNotExist(err) {
		t.Errorf("pins %s exist while unavailable (stat: %v)", pins, err)
	}
	if err := u.Stop(); err != nil {
		t.Fatal(err)
	}
}

// askAgent asks the agent's socket whether a netns is accelerated (what
// meshcnictl inspect can show).
func askAgent(ctx context.Context, t *testing.T, runDir string, cookie uint64) *agentsock.EBPFResponse {
	t.Helper()
	c, err := agentsock.Dial(runDir)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	r, err := c.EBPF(ctx, cookie)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// startMeshed runs a meshed pod with the annotation (AccelDefault: none), waits
// until it runs and returns its netns.
func startMeshed(ctx context.Context, t *testing.T, tb *testbed.Testbed, name string, a capture.Acceleration) string {
	t.Helper()
	p := meshedPod(name)
	if a != capture.AccelDefault {
		p.Annotations[capture.AnnotationEBPFAcceleration] = string(a)
	}
	if _, err := tb.CreatePod(ctx, p); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tb.DeletePod(context.Background(), e2eNS, name) })
	if _, err := tb.WaitPodRunning(ctx, e2eNS, name); err != nil {
		t.Fatal(err)
	}
	netns, err := tb.PodNetns(ctx, e2eNS, name)
	if err != nil {
		t.Fatal(err)
	}
	return netns
}

// sendToProxy runs the stand-in proxy in the pod (UID 1337, record mode) and, as the
// app, sends n bytes to ebpfDst: the redirect takes them to the proxy, which answers
// with the original destination it read (SO_ORIGINAL_DST).
func sendToProxy(t *testing.T, netns string, n int) {
	t.Helper()
	traffic.StartProxy(t, netns, traffic.ProxyOptions{Args: []string{"--log-level=error"}})
	rec := traffic.SendBulk(t, netns, ebpfDst, n)
	if rec.Listener != proxysim.ListenerOutbound || rec.OrigDst != ebpfDst {
		t.Fatalf("proxy saw listener %s, original destination %v; want %s, %v", rec.Listener, rec.OrigDst, proxysim.ListenerOutbound, ebpfDst)
	}
}
