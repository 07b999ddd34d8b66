package plugin_test

// The pod lookup through the node agent: the real agent socket server
// (pkg/agent.SocketServer) answering from a real informer cache of a node's pods
// (pkg/agent/nodepods against the test bed's API server); the plugin binary driven through
// libcni. A counting TCP proxy in front of the API server shows whether the plugin
// opened a connection to it at all.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/types"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/agent"
	"github.com/meshcni/meshcni/pkg/agent/nodepods"
	"github.com/meshcni/meshcni/pkg/agentsock"
)

// countingProxy forwards TCP to the API server and counts the connections it accepts:
// the plugin opens one per process that talks to the API server.
type countingProxy struct {
	ln    net.Listener
	conns atomic.Int64
	wg    sync.WaitGroup
}

func newCountingProxy(t testing.TB, target string) *countingProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &countingProxy{ln: ln}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			p.conns.Add(1)
			p.wg.Add(1)
			go func() {
				defer p.wg.Done()
				defer c.Close()
				up, err := net.Dial("tcp", target)
				if err != nil {
					return
				}
				defer up.Close()
				done := make(chan struct{}, 2)
				go func() { _, _ = io.Copy(up, c); done <- struct{}{} }()
				go func() { _, _ = io.Copy(c, up); done <- struct{}{} }()
				<-done
			}()
		}
	}()
	t.Cleanup(func() { ln.Close(); p.wg.Wait() })
	return p
}

func (p *countingProxy) addr() string { return p.ln.Addr().String() }

// kubeconfigVia writes the test bed's kubeconfig with its server replaced by addr
// (the serving certificate is valid for 127.0.0.1).
func kubeconfigVia(t testing.TB, tbd *testbed.Testbed, addr string) string {
	t.Helper()
	kc, err := os.ReadFile(tbd.Kubeconfig())
	if err != nil {
		t.Fatal(err)
	}
	orig := fmt.Sprintf("https://%s:%d", testbed.APIServerHost, testbed.APIServerPort)
	if !strings.Contains(string(kc), orig) {
		t.Fatalf("test bed kubeconfig has no server %s", orig)
	}
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(path, []byte(strings.ReplaceAll(string(kc), orig, "https://"+addr)), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// deadAddr is a loopback address nothing listens on.
func deadAddr(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// nodePod stores pod bound to node (a node name no kubelet serves: only the API
// object and the agent's cache of that node matter) and deletes it when t ends.
func nodePod(t testing.TB, node string, pod *corev1.Pod) *corev1.Pod {
	t.Helper()
	c := testbedAPI(t).Client
	ensureNamespace(t, pod.Namespace)
	pod.Name = fmt.Sprintf("%s-%04x", pod.Name, rand.Uint32()&0xffff)
	no := false
	pod.Spec.AutomountServiceAccountToken = &no
	pod.Spec.NodeName = node
	created, err := c.CoreV1().Pods(pod.Namespace).Create(context.Background(), pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create pod %s/%s: %v", pod.Namespace, pod.Name, err)
	}
	t.Cleanup(func() {
		zero := int64(0)
		_ = c.CoreV1().Pods(pod.Namespace).Delete(context.Background(), pod.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero})
	})
	return created
}

// fakeNode is a node name of this test run's own.
func fakeNode() string { return fmt.Sprintf("meshcni-lookup-%06x", rand.Uint32()&0xffffff) }

// nodeCache runs the agent's informer cache of node's pods until t ends.
func nodeCache(t testing.TB, tbd *testbed.Testbed, node string) *nodepods.Cache {
	t.Helper()
	c, err := nodepods.New(tbd.Client, node, 0)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	wctx, wcancel := context.WithTimeout(ctx, 30*time.Second)
	defer wcancel()
	if !c.WaitForSync(wctx) {
		t.Fatal("node pod cache did not sync")
	}
	return c
}

// waitCached waits until the cache holds the pod.
func waitCached(t testing.TB, c *nodepods.Cache, pod *corev1.Pod) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		if p, ok := c.Get(pod.Namespace, pod.Name); ok && p.UID == pod.UID {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("pod %s/%s never reached the agent's cache", pod.Namespace, pod.Name)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// startAgentSocket serves the real agent socket in a new run dir with pods (nil: an
// agent without API access) and returns the run dir.
func startAgentSocket(t testing.TB, pods agent.PodSource) string {
	t.Helper()
	runDir, err := os.MkdirTemp("/run", "meshcni-lookup-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(runDir) })
	srv := &agent.SocketServer{Path: agentsock.Path(runDir), Log: slog.New(slog.DiscardHandler), Metrics: agent.NewMetrics()}
	if pods != nil {
		srv.Pods = pods
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	deadline := time.Now().Add(5 * time.Second)
	for {
		if c, err := agentsock.Dial(runDir); err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("agent socket not listening")
		}
		time.Sleep(5 * time.Millisecond)
	}
	fi, err := os.Stat(agentsock.Path(runDir))
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 || fi.Mode()&os.ModeSocket == 0 {
		t.Fatalf("agent socket mode %v, want a socket with mode 0600 (root only: it answers with pods)", fi.Mode())
	}
	return runDir
}

// TestAgentPodLookup: when the agent's cache holds the pod with the runtime's UID the
// plugin makes no connection to the API server at all (it even works with the API
// server unreachable); on every kind of miss it falls back to the API GET, with the
// same fail-closed errors as without an agent.
func TestAgentPodLookup(t *testing.T) {
	tbd := testbedAPI(t)
	node := fakeNode()
	cache := nodeCache(t, tbd, node)
	cached := nodePod(t, node, injectedPod(e2eNamespace, "lookup"))
	waitCached(t, cache, cached)
	uncached := createPod(t, injectedPod(e2eNamespace, "lookup-miss")) // unscheduled: on no node

	proxy := newCountingProxy(t, fmt.Sprintf("%s:%d", testbed.APIServerHost, testbed.APIServerPort))
	viaProxy := kubeconfigVia(t, tbd, proxy.addr())
	apiDown := kubeconfigVia(t, tbd, deadAddr(t))
	withCache := startAgentSocket(t, cache)
	noCache := startAgentSocket(t, nil)

	stale := cached.DeepCopy()
	stale.UID = "00000000-0000-0000-0000-00000000cafe"
	noUID := cached.DeepCopy()
	noUID.UID = ""

	tests := []struct {
		name       string
		runDir     string
		kubeconfig string
		pod        *corev1.Pod
		wantConns  bool   // the plugin connected to the API server
		wantErr    string // "" = ADD succeeds and the pod is meshed
		wantCode   uint
	}{
		{"agent answers: no API connection", withCache, viaProxy, cached, false, "", 0},
		{"no K8S_POD_UID: the agent misses, API GET", withCache, viaProxy, noUID, true, "", 0},
		{"agent answers with the API server down", withCache, apiDown, cached, false, "", 0},
		{"pod not in the agent's cache: API GET", withCache, viaProxy, uncached, true, "", 0},
		{"agent without a cache: API GET", noCache, viaProxy, cached, true, "", 0},
		{"stale UID in the cache: API GET, which fails closed", withCache, viaProxy, stale, true,
			"pod " + e2eNamespace + "/" + cached.Name + " in the API has UID " + string(cached.UID) + " but the runtime is creating UID " + string(stale.UID), uint(types.ErrInternal)},
		{"agent misses and the API server is down: fails closed", withCache, apiDown, uncached, false,
			"cannot reach the Kubernetes API at https://", uint(types.ErrTryAgainLater)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			netns := testutil.NewNetns(t)
			ch := newChain(t, []string{"10.250.0.2/24"}, meshcniEntry(tt.runDir, tt.kubeconfig, map[string]any{"api_timeout": "1s"}))
			rt := runtimeConf(netns, tt.pod)
			before := proxy.conns.Load()
			_, err := ch.cfg.AddNetworkList(context.Background(), ch.list, rt)
			conns := proxy.conns.Load() - before
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("ADD: %v", err)
				}
				if len(live(t, netns)) == 0 {
					t.Fatal("no rules for a meshed pod")
				}
				if err := ch.cfg.DelNetworkList(context.Background(), ch.list, rt); err != nil {
					t.Fatalf("DEL: %v", err)
				}
				if l := live(t, netns); len(l) != 0 {
					t.Fatalf("rules left after DEL: %v", l)
				}
			} else {
				var e *types.Error
				if !errors.As(err, &e) || !strings.Contains(e.Msg, tt.wantErr) || !strings.Contains(e.Msg, "fails closed") || e.Code != tt.wantCode {
					t.Fatalf("ADD error %v, want code %d and %q", err, tt.wantCode, tt.wantErr)
				}
				if l := live(t, netns); len(l) != 0 {
					t.Fatalf("rules applied: %v", l)
				}
			}
			if got := conns > 0; got != tt.wantConns {
				t.Fatalf("connections to the API server: %d, want any: %v", conns, tt.wantConns)
			}
		})
	}
}
