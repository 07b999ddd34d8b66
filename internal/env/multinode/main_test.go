package multinode_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/internal/env/multinode"
	"github.com/meshcni/meshcni/internal/env/testbed"
)

// Nodes is how many nodes the package's cluster has: node 1 and two extra nodes.
const Nodes = 3

var (
	clusterMu  sync.Mutex
	shared     *multinode.Cluster
	installErr error
)

func TestMain(m *testing.M) {
	os.Exit(testbed.RunMainThen(m, func(*testbed.Testbed) error {
		clusterMu.Lock()
		defer clusterMu.Unlock()
		if shared == nil {
			return nil
		}
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		// Also a check: helm uninstall leaves no node with the plugin.
		return shared.Uninstall(ctx)
	}))
}

// cluster is the package's cluster: the shared test bed with Nodes nodes and
// meshcni installed on every one of them, started and installed once. Tests that
// change it (add a node, upgrade the release) restore what the others rely on:
// Nodes nodes, every one meshed.
func cluster(t testing.TB) *multinode.Cluster {
	t.Helper()
	tb := testbed.SharedNodes(t, Nodes)
	clusterMu.Lock()
	defer clusterMu.Unlock()
	if installErr != nil {
		t.Fatalf("meshcni failed to install earlier: %v", installErr)
	}
	if shared != nil {
		return shared
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	began := time.Now()
	c, err := multinode.Install(ctx, tb, multinode.Options{Log: slog.New(slog.NewTextHandler(os.Stderr, nil))})
	if err != nil {
		installErr = err
		if c != nil {
			shared = c // uninstalled by TestMain
		}
		t.Fatalf("install meshcni on %d nodes: %v", Nodes, err)
	}
	t.Logf("meshcni installed and every node meshed in %s", time.Since(began).Round(time.Millisecond))
	shared = c
	return c
}

// namespace creates a namespace for one test, deleted (not waited for) at its end.
func namespace(t testing.TB, c *multinode.Cluster, name string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := c.TB.CreateNamespace(ctx, name); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = c.TB.Client.CoreV1().Namespaces().Delete(context.Background(), name, metav1.DeleteOptions{})
	})
	return name
}

// TestMeshedOnEveryNode is the harness's own proof: on every node the agent is
// Ready, the plugin in that node's CNI configuration once, the node untainted
// (Install waited for it), the agent's metrics answer on the node's IP, a meshed
// pod pinned to the node is redirected and a plain one is not, both audited from
// their node.
func TestMeshedOnEveryNode(t *testing.T) {
	c := cluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	ns := namespace(t, c, "mn-every")
	nodes := c.TB.Nodes()
	if len(nodes) != Nodes {
		t.Fatalf("%d nodes, want %d", len(nodes), Nodes)
	}
	for i, n := range nodes {
		if err := c.NodeMeshed(ctx, n); err != nil {
			t.Error(err)
		}
		m, err := c.AgentMetrics(ctx, n.Name)
		if err != nil || !strings.Contains(m, "# TYPE ") {
			t.Errorf("agent metrics on %s: %v (%d bytes)", n.Name, err, len(m))
		}
		meshed := c.MeshedPod(ns, fmt.Sprintf("meshed-%d", i+1), n.Name)
		plain := c.MeshedPod(ns, fmt.Sprintf("plain-%d", i+1), n.Name)
		plain.Annotations = nil
		plain.Spec.InitContainers = nil
		if _, err := c.TB.CreatePod(ctx, meshed); err != nil {
			t.Fatal(err)
		}
		if _, err := c.TB.CreatePod(ctx, plain); err != nil {
			t.Fatal(err)
		}
	}
	for i, n := range nodes {
		meshed, err := c.TB.WaitPodReady(ctx, ns, fmt.Sprintf("meshed-%d", i+1))
		if err != nil {
			t.Fatal(err)
		}
		if meshed.Spec.NodeName != n.Name {
			t.Fatalf("pod %s on %s, want %s", meshed.Name, meshed.Spec.NodeName, n.Name)
		}
		if err := c.Redirected(ctx, meshed); err != nil {
			t.Error(err)
		}
		plain, err := c.TB.WaitPodReady(ctx, ns, fmt.Sprintf("plain-%d", i+1))
		if err != nil {
			t.Fatal(err)
		}
		if err := c.Redirected(ctx, plain); err == nil {
			t.Errorf("plain pod %s on %s judged redirected", plain.Name, n.Name)
		}
		rep, err := c.Inspect(ctx, plain)
		if err != nil || rep.Status != "not-meshed" {
			t.Errorf("inspect plain pod %s on %s: %+v, %v; want not-meshed", plain.Name, n.Name, rep, err)
		}
	}
}
