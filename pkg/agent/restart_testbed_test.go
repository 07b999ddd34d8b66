package agent_test

// The agent's per-sandbox state across its restart, with the real agent binary.
// TestEBPFDelAfterRestart needs root and a kernel that runs the eBPF programs, not
// the test bed: the plugin's reports are sent on the agent's socket as the plugin
// sends them. TestAuditAnnotationsAcrossRestartOnTestbed runs on the test bed.

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
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/testkit/agenttest"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/internal/testkit/traffic"
	"github.com/meshcni/meshcni/pkg/agent"
	"github.com/meshcni/meshcni/pkg/agentsock"
	"github.com/meshcni/meshcni/pkg/audit"
	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/capture/k8spod"
	"github.com/meshcni/meshcni/pkg/ebpf/sockmap"
	"github.com/meshcni/meshcni/pkg/engine"
)

// sharedRunDir is a run directory both agents of a test use (short: the socket's
// path must fit a sockaddr_un).
func sharedRunDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "mcni-rs-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// report sends a command result on the agent's socket, as the plugin does.
func report(t *testing.T, runDir string, r *agentsock.CommandResult) {
	t.Helper()
	var c *agentsock.Client
	waitFor(t, 10*time.Second, "the agent's socket", func() (err error) {
		c, err = agentsock.Dial(runDir)
		return err
	})
	defer c.Close()
	if err := c.Report(r); err != nil {
		t.Fatal(err)
	}
}

// TestEBPFDelAfterRestart: the real agent binary with eBPF acceleration (the real
// programs and allow-list map, pinned in bpffs). The plugin's ADD of a meshed
// sandbox (the cookie of a real network namespace) puts the namespace on the
// allow-list; the agent restarts (--keep-on-exit: the pins stay); the sandbox's
// DEL, received by the new agent, takes the cookie off the map. The sandbox's
// state file is gone after the DEL.
func TestEBPFDelAfterRestart(t *testing.T) {
	testutil.RequireRoot(t)
	pins := filepath.Join(testutil.BPFFS(t), "meshcni-restart")
	t.Cleanup(func() { // after both agents stopped (cleanups run last in, first out)
		if err := sockmap.Unload(sockmap.Options{PinDir: pins}); err != nil {
			t.Errorf("unload: %v", err)
		}
	})
	runDir := sharedRunDir(t)
	conf, bin := t.TempDir(), t.TempDir()
	if err := os.WriteFile(filepath.Join(conf, "10-test.conflist"), []byte(`{"cniVersion":"1.0.0","name":"test","plugins":[{"type":"bridge"}]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(kubeconfig, []byte("apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\nusers: [{name: u, user: {token: t}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\ncurrent-context: x\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	opts := agenttest.Options{ConfDir: conf, BinDir: bin, Kubeconfig: kubeconfig, NoKubeconfig: true, NodeName: "-",
		Args: []string{"--run-dir", runDir, "--ebpf-acceleration", "auto", "--ebpf-pin-dir", pins, "--keep-on-exit"}}
	first := agenttest.Start(t, opts)
	if v := value(t, first.Metrics(t), "meshcni_ebpf_available", nil); v != 1 {
		_, body, _ := first.Ready()
		testutil.Missing(t, "eBPF acceleration unavailable on this kernel: %s", body)
	}
	pod := traffic.NewPod(t)
	cookie, err := sockmap.NetnsCookie(pod.NetNS)
	if err != nil {
		t.Fatal(err)
	}
	const sandbox = "0a1b2c3d4e5f"
	report(t, runDir, &agentsock.CommandResult{Command: agentsock.CommandAdd, Result: agentsock.ResultSuccess, ContainerID: sandbox,
		Pod:  agentsock.Pod{Namespace: "app", Name: "web"},
		EBPF: &agentsock.PodEBPF{NetnsCookie: cookie, Mode: string(capture.AccelToProxy), ProxyUID: traffic.ProxyUID, PodUID: "uid-web"}})
	ctx := context.Background()
	waitFor(t, 10*time.Second, "the sandbox enabled", func() error {
		if r := askAgent(ctx, t, runDir, cookie); !r.Accelerated {
			return fmt.Errorf("not accelerated: %+v", r)
		}
		return nil
	})
	if err := first.Stop(); err != nil {
		t.Fatal(err)
	}

	second := agenttest.Start(t, opts)
	if r := askAgent(ctx, t, runDir, cookie); !r.Accelerated {
		t.Fatalf("after the restart the pins should still allow the netns: %+v", r)
	}
	report(t, runDir, &agentsock.CommandResult{Command: agentsock.CommandDel, Result: agentsock.ResultSuccess, ContainerID: sandbox,
		Pod: agentsock.Pod{Namespace: "app", Name: "web"}})
	waitFor(t, 10*time.Second, "the sandbox disabled by its DEL after the restart", func() error {
		if r := askAgent(ctx, t, runDir, cookie); r.Accelerated {
			return fmt.Errorf("still on the allow-list: %+v", r)
		}
		return nil
	})
	if _, err := os.Stat(filepath.Join(runDir, agent.SandboxDirName, sandbox+".json")); !os.IsNotExist(err) {
		t.Errorf("the sandbox's state file after its DEL: %v", err)
	}
	if err := second.Stop(); err != nil {
		t.Fatal(err)
	}
}

// TestAuditAnnotationsAcrossRestartOnTestbed: a meshed pod started through the
// chain while one agent runs; that agent stops (--keep-on-exit), the pod's
// traffic annotations change, the next agent starts on the same run directory.
// It reports the change (Warning Event MeshcniAnnotationsChanged, the log line
// naming the spec the pod was redirected with) and keeps the redirect the plugin
// wrote: the pod's netns still holds the first spec, no drift Event.
func TestAuditAnnotationsAcrossRestartOnTestbed(t *testing.T) {
	tb := testbed.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if err := tb.CreateNamespace(ctx, e2eNS); err != nil && !apierrors.IsAlreadyExists(err) && !strings.Contains(err.Error(), "already exists") {
		t.Fatal(err)
	}
	const period = 2 * time.Second
	runDir := sharedRunDir(t)
	opts := agenttest.Options{Args: []string{"--run-dir", runDir, "--keep-on-exit", "--resync", "200ms", "--backend", "nftables",
		"--audit-period", period.String(), "--repair-netns-dirs", testbed.NetnsDir}}
	first := agenttest.Start(t, opts)
	const name = "restart-annotations"
	if _, err := tb.CreatePod(ctx, meshedPod(name)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tb.DeletePod(context.Background(), e2eNS, name) })
	pod, err := tb.WaitPodRunning(ctx, e2eNS, name)
	if err != nil {
		t.Fatal(err)
	}
	netns, err := tb.PodNetns(ctx, e2eNS, name)
	if err != nil {
		t.Fatal(err)
	}
	res, err := capture.Config{}.ForPod(k8spod.From(pod), []netip.Addr{netip.MustParseAddr(pod.Status.PodIP)})
	if err != nil {
		t.Fatal(err)
	}
	applied := res.Spec
	waitFor(t, 10*time.Second, "the sandbox's spec recorded", func() error {
		files, _ := filepath.Glob(filepath.Join(runDir, agent.SandboxDirName, "*.json"))
		for _, f := range files {
			if b, err := os.ReadFile(f); err == nil && strings.Contains(string(b), `"name":"`+name+`"`) && strings.Contains(string(b), `"spec":`) {
				return nil
			}
		}
		return fmt.Errorf("no state file with the pod's spec among %v", files)
	})
	if err := first.Stop(); err != nil {
		t.Fatal(err)
	}

	patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:"8080"}}}`, capture.AnnotationExcludeOutboundPorts)
	if _, err := tb.Client.CoreV1().Pods(e2eNS).Patch(ctx, name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	second := agenttest.Start(t, opts)
	msg := podEvent(t, ctx, tb, pod, audit.EventAnnotationsChanged, 5*period)
	if !strings.Contains(msg, "keeps its redirect") {
		t.Errorf("Event message %q: want the redirect kept", msg)
	}
	want := fmt.Sprintf(`"redirected_with":%q`, audit.Hash(applied))
	if log := second.Log(); !strings.Contains(log, audit.LogChanged) || !strings.Contains(log, want) {
		t.Errorf("the new agent's log: want %q with %s", audit.LogChanged, want)
	}
	rounds := value(t, second.Metrics(t), "meshcni_audit_rounds_total", nil)
	metricAtLeast(t, second, "meshcni_audit_rounds_total", nil, rounds+2) // more rounds: nothing rewrites the redirect
	if d, err := engine.Check(ctx, engine.Options{Backend: backend.Nftables, NetnsPath: netns}, applied); err != nil || !d.Empty() {
		t.Errorf("the pod's redirect after the restart (want the first spec): %v\n%s", err, d)
	}
	evs, err := tb.Client.CoreV1().Events(e2eNS).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.uid=" + string(pod.UID)})
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range evs.Items {
		if e.Reason == audit.EventDrift {
			t.Errorf("drift Event after the restart: %s", e.Message)
		}
	}
	if err := second.Stop(); err != nil {
		t.Fatal(err)
	}
}
