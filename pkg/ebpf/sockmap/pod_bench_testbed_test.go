package sockmap_test

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/testkit/agenttest"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/ebpf/sockmap"
)

func TestMain(m *testing.M) {
	code := testbed.RunMain(m)
	agenttest.RemoveBinaries()
	os.Exit(code)
}

// benchNS holds BenchmarkPodHop's pods.
const benchNS = "ebpf-bench"

// Ports of the in-process servers: the peer's echo and sink, the app's echo (all
// clear of the echo image's 8080 and the proxy's 15xxx).
const (
	peerEchoPort = 18080
	peerSinkPort = 18082
	appEchoPort  = 19090
)

// BenchmarkPodHop is BenchmarkHop in a meshed pod on the test bed: kubelet runs the
// pod through the CNI chain, where meshcni's plugin writes its redirect; the node
// agent (the binary, --ebpf-acceleration auto, as a host process) loads the programs
// and enables the pod, annotated meshcni.io/ebpf-acceleration=to-proxy, from the
// netns cookie the plugin reports. The stand-in proxy (UID 1337, forwarding without
// splice) and the app (this test binary) run in the pod's network namespace; the
// peer is another pod on the node. Each arm then puts the pod in its mode with the
// calls the agent makes (Enable / Disable on the agent's pinned allow-list; the agent
// itself decides a pod's mode once, at its ADD), interleaved as in BenchmarkHop:
// rr = 64 B request/response app → proxy → peer pod, rr-in = peer pod → proxy → app,
// bulk = 4 MiB upload, connect = 20 connections set up, 1 B echoed and closed. As in
// BenchmarkHop, each sub-benchmark fails unless the counters of the agent's programs
// show bytes redirected in the accelerated arms and nothing in the off arm.
//
//	go test -run '^$' -bench PodHop -benchtime 150x -count 3 ./pkg/ebpf/sockmap/   # root, the test bed built
func BenchmarkPodHop(b *testing.B) {
	tb := testbed.Shared(b)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	if err := tb.CreateNamespace(ctx, benchNS); err != nil && !apierrors.IsAlreadyExists(err) && !strings.Contains(err.Error(), "already exists") {
		b.Fatal(err)
	}
	pins := filepath.Join(testutil.BPFFS(b), "meshcni-bench")
	agenttest.Start(b, agenttest.Options{Args: []string{"--ebpf-acceleration", "auto", "--ebpf-pin-dir", pins, "--keep-on-exit=never"}})

	appNS, appIP := benchPod(ctx, b, tb, "bench-app", true)
	peerNS, peerIP := benchPod(ctx, b, tb, "bench-peer", false)
	a, err := sockmap.Load(sockmap.Options{PinDir: pins}) // re-opens the agent's pins
	if err != nil {
		b.Fatalf("open the agent's pinned programs: %v", err)
	}
	b.Cleanup(func() { a.Close() })
	ck := cookie(b, appNS)
	if ok, err := a.Enabled(ck); err != nil || !ok {
		b.Fatalf("the agent did not enable bench-app (netns cookie %d): %v %v", ck, ok, err)
	}
	startEcho(b, peerNS, fmt.Sprintf("[::]:%d", peerEchoPort))
	startEcho(b, appNS, fmt.Sprintf("[::]:%d", appEchoPort))
	go serveSink(listenIn(b, peerNS, fmt.Sprintf("[::]:%d", peerSinkPort)))
	proxy := startProxy(b, appNS)
	benchHops(b, hops{
		set:   setter(b, a, ck),
		stats: func() sockmap.Stats { return stats(b, a) },
		pids:  []int{os.Getpid(), proxy.Cmd.Process.Pid},
		app:   appNS, peer: peerNS,
		out: netip.AddrPortFrom(peerIP, peerEchoPort), in: netip.AddrPortFrom(appIP, appEchoPort),
		sink: netip.AddrPortFrom(peerIP, peerSinkPort),
	})
	if s, err := a.Stats(); err == nil {
		b.Logf("stats: %+v", s)
	}
}

// benchPod runs a pod on the test bed — meshed (Istio's injection, annotated
// to-proxy) or plain — and returns its network namespace and IPv4 address.
func benchPod(ctx context.Context, b *testing.B, tb *testbed.Testbed, name string, meshed bool) (string, netip.Addr) {
	b.Helper()
	p := testbed.EchoPod(name, 0)
	p.Namespace = benchNS
	if meshed {
		p.Annotations = map[string]string{
			capture.AnnotationStatus:           `{"containers":["istio-proxy"]}`,
			capture.AnnotationEBPFAcceleration: string(capture.AccelToProxy),
		}
		p.Spec.Containers[0].ReadinessProbe = nil // it would be redirected to a proxy not yet there
		p.Spec.Containers = append(p.Spec.Containers, corev1.Container{
			Name: capture.ProxyContainer, Image: testbed.EchoImage, ImagePullPolicy: corev1.PullNever,
			Env: []corev1.EnvVar{{Name: "PORT", Value: "15021"}},
		})
	}
	if _, err := tb.CreatePod(ctx, p); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = tb.DeletePod(context.Background(), benchNS, name) })
	running, err := tb.WaitPodRunning(ctx, benchNS, name)
	if err != nil {
		b.Fatal(err)
	}
	ip, err := netip.ParseAddr(running.Status.PodIP)
	if err != nil {
		b.Fatalf("pod %s IP %q: %v", name, running.Status.PodIP, err)
	}
	ns, err := tb.PodNetns(ctx, benchNS, name)
	if err != nil {
		b.Fatal(err)
	}
	return ns, ip
}
