package e2e

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/meshcni/meshcni/internal/env/istio"
	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
)

// The package installs Istio (and meshcni) once: the first test that needs it calls
// up. After the last test, a test bed this binary started stops with everything in
// it; one it attached to (hack/testbed up) outlives the binary, so TestMain removes
// Istio and meshcni from it (istio.Down).
var (
	upOnce   sync.Once
	upErr    error
	upInst   *istio.Installed
	upTook   time.Duration
	upRoot   string
	upNeeded bool
)

func TestMain(m *testing.M) {
	os.Exit(testbed.RunMainThen(m, func(tb *testbed.Testbed) error {
		if !upNeeded || tb.Owned() {
			return nil
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		began := time.Now()
		if err := istio.Down(ctx, tb, istio.Options{RepoRoot: upRoot}); err != nil {
			return fmt.Errorf("istio down: %w", err)
		}
		slog.Info("istio and meshcni removed", "took", time.Since(began).Round(time.Millisecond))
		return nil
	}))
}

// up returns the shared test bed with Istio and meshcni installed, installing them
// on first use. It skips (fails under CI=true) without root, go, ctr or the Istio
// build.
func up(t testing.TB) *testbed.Testbed {
	t.Helper()
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "go")
	testutil.RequireBinary(t, "ctr")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	if _, err := istio.Lookup(ctx); err != nil {
		testutil.Missing(t, "%v", err)
	}
	tb := testbed.Shared(t)
	upOnce.Do(func() {
		upNeeded = true
		if upRoot, upErr = testbed.RepoRoot(); upErr != nil {
			return
		}
		began := time.Now()
		upInst, upErr = istio.Up(ctx, tb, sharedOptions())
		upTook = time.Since(began)
		if upInst != nil {
			for _, s := range upInst.Steps {
				t.Logf("%8s  %s", s.Took.Round(time.Millisecond), s.Name)
			}
		}
		if upErr == nil {
			t.Logf("istio %s (%s) and meshcni up in %s", upInst.Build.Version, upInst.Build.Release, upTook.Round(time.Millisecond))
		}
	})
	if upErr != nil {
		t.Fatalf("istio up: %v", upErr)
	}
	return tb
}

// upParallel is up for a test that changes nothing the package's tests share (the
// install, the node's CNI chain, the agent, the node's taints): it runs in parallel
// with the others like it (at most -test.parallel at once, GOMAXPROCS by default),
// after the package's other tests, which change them and restore them when they end.
func upParallel(t *testing.T) *testbed.Testbed {
	t.Helper()
	t.Parallel()
	return up(t)
}

// useNamespace deletes the namespace (and waits until it is gone) when the test ends.
func useNamespace(t *testing.T, tb *testbed.Testbed, ns string) {
	t.Helper()
	t.Cleanup(func() {
		began := time.Now()
		if err := istio.DeleteNamespace(context.Background(), tb, ns); err != nil {
			t.Error(err)
		}
		t.Logf("namespace %s deleted in %s", ns, time.Since(began).Round(time.Millisecond))
	})
}

// sharedOptions are the options of the package's one Istio install: Istio's charts
// with the validation-free injection template added to istiod's values, and meshcni.
// A test that reinstalls istiod differently restores it with these.
func sharedOptions() istio.Options {
	return istio.Options{RepoRoot: upRoot, ValuesFiles: []string{filepath.Join(upRoot, validationFreeValues)}}
}

// withTaint is o reinstalling istiod only, with extra istiod values.
func withTaint(o istio.Options, values map[string]any) istio.Options {
	o.Reinstall = true
	o.SkipMeshcni = true
	o.ExtraValues = values
	return o
}
