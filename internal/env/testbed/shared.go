package testbed

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
)

// SharedNodeGrace is the node monitor grace period of a multi-node test bed that
// SharedNodes starts: two missed node-lease renewals (every 10 s), not Kubernetes'
// default 50 s.
const SharedNodeGrace = 20 * time.Second

var (
	sharedMu   sync.Mutex
	sharedTB   *Testbed
	mainWraps  bool
	sharedFail error
)

// RunMain runs the tests of a package that uses Shared and stops the shared test
// bed afterwards. Use it from TestMain:
//
//	func TestMain(m *testing.M) { os.Exit(testbed.RunMain(m)) }
//
// Without it, Shared stops the test bed at the end of the test that started it.
func RunMain(m *testing.M) int { return RunMainThen(m, nil) }

// RunMainThen is RunMain that calls then with the shared test bed, when the tests used
// one, after the last test and before the test bed stops (to uninstall what the
// package's tests shared, say); an error from it fails the run.
func RunMainThen(m *testing.M, then func(*Testbed) error) int {
	sharedMu.Lock()
	mainWraps = true
	sharedMu.Unlock()
	code := m.Run()
	sharedMu.Lock()
	tb := sharedTB
	sharedTB = nil
	sharedMu.Unlock()
	if tb != nil && then != nil {
		if err := then(tb); err != nil {
			slog.Error("after the tests", "err", err)
			if code == 0 {
				code = 1
			}
		}
	}
	if tb != nil {
		if err := tb.Stop(context.Background()); err != nil {
			slog.Error("stop shared test bed", "err", err)
			if code == 0 {
				code = 1
			}
		}
	}
	return code
}

// Shared returns the full-mode test bed of this test binary, starting it on first
// use: it attaches to one started by `hack/testbed up` if running, else starts one
// (waiting for LockFile while another test binary holds it). It skips the test
// outside CI, and fails it under CI=true, when not root or when the binaries are
// not built (`hack/testbed build`); in short mode (-short) it always skips.
//
// Tests sharing it must restore what they change (CNI configuration, plugins in
// CNIBinDir) and use their own namespaces or pod names.
func Shared(t testing.TB) *Testbed {
	t.Helper()
	return SharedNodes(t, 1)
}

// SharedNodes is Shared with at least nodes nodes: a test bed it starts runs
// Options.Nodes = nodes; to one already running (this binary's, or attached)
// it adds the missing extra nodes (NodeName-2, NodeName-3, …), which then stay
// until the test bed stops. A multi-node test bed it starts marks a node NotReady
// after SharedNodeGrace without a heartbeat (a dead node's pods move in test time).
func SharedNodes(t testing.TB, nodes int) *Testbed {
	t.Helper()
	requireBuilt(t)
	sharedMu.Lock()
	defer sharedMu.Unlock()
	if tb := runningShared(); tb != nil {
		return ensureNodes(t, tb, nodes)
	}
	if sharedFail != nil {
		t.Fatalf("shared test bed failed to start earlier: %v", sharedFail)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	if _, _, ok := Running(); ok {
		tb, err := Attach(ctx)
		if err != nil {
			t.Fatalf("attach to the running test bed: %v", err)
		}
		if tb.Mode != ModeFull {
			t.Fatalf("the running test bed is %s; Shared needs a full one (hack/testbed down && hack/testbed up)", tb.Mode)
		}
		sharedTB = tb
		return ensureNodes(t, tb, nodes)
	}
	opts := Options{Nodes: nodes, Logger: slog.New(slog.NewTextHandler(os.Stderr, nil))}
	if nodes > 1 {
		opts.NodeMonitorGracePeriod = SharedNodeGrace
	}
	tb, err := Start(ctx, opts)
	if err != nil {
		sharedFail = err
		t.Fatalf("start test bed: %v", err)
	}
	sharedTB = tb
	if !mainWraps {
		t.Cleanup(func() {
			sharedMu.Lock()
			sharedTB = nil
			sharedMu.Unlock()
			if err := tb.Stop(context.Background()); err != nil {
				t.Errorf("stop test bed: %v", err)
			}
		})
	}
	return tb
}

// ensureNodes adds to tb the extra nodes NodeName-k (k = 2..nodes) it lacks.
func ensureNodes(t testing.TB, tb *Testbed, nodes int) *Testbed {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	for k := 2; len(tb.Nodes()) < nodes && k <= MaxNodes; k++ {
		name := fmt.Sprintf("%s-%d", NodeName, k)
		if _, err := tb.Node(name); err == nil {
			continue
		}
		if _, err := tb.AddNode(ctx, name); err != nil {
			t.Fatalf("add node %s to the shared test bed: %v", name, err)
		}
	}
	if got := len(tb.Nodes()); got < nodes {
		t.Fatalf("the shared test bed has %d nodes, want %d", got, nodes)
	}
	return tb
}

// API returns a test bed with at least an API server for a test that needs no
// node: this test binary's shared test bed when one is up (a full node is a
// superset), else an API-only one (etcd + kube-apiserver) stopped when the
// test ends. Use it rather than Start in tests, so a package mixing Shared and
// API-only tests never waits on its own lock. Skips/fails like Shared.
func API(t testing.TB) *Testbed {
	t.Helper()
	requireBuilt(t)
	sharedMu.Lock()
	defer sharedMu.Unlock()
	if tb := runningShared(); tb != nil {
		return tb
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	if _, _, ok := Running(); ok {
		tb, err := Attach(ctx)
		if err != nil {
			t.Fatalf("attach to the running test bed: %v", err)
		}
		return tb
	}
	tb, err := Start(ctx, Options{APIOnly: true, Logger: slog.New(slog.NewTextHandler(os.Stderr, nil))})
	if err != nil {
		t.Fatalf("start API-only test bed: %v", err)
	}
	t.Cleanup(func() {
		if err := tb.Stop(context.Background()); err != nil {
			t.Errorf("stop test bed: %v", err)
		}
	})
	return tb
}

// requireBuilt skips the test outside CI, and fails it under CI=true, when not root
// or when the test bed's binaries are not built. It always skips in short mode
// (unit tests only, `make unit`).
func requireBuilt(t testing.TB) {
	t.Helper()
	testutil.Unit(t, "the test bed")
	testutil.RequireRoot(t)
	if _, err := Lookup(); err != nil {
		if errors.Is(err, ErrNotBuilt) {
			testutil.Missing(t, "%v", err)
		}
		t.Fatalf("testbed: %v", err)
	}
}

// runningShared is this binary's shared test bed when it is still usable (attached,
// or started by us and running); nil otherwise. Call it with sharedMu held.
func runningShared() *Testbed {
	if sharedTB != nil && (!sharedTB.owned || sharedTB.IsRunning()) {
		return sharedTB
	}
	return nil
}
