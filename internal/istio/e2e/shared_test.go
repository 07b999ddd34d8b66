package e2e

import (
	"context"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/meshcni/meshcni/internal/istio"
	"github.com/meshcni/meshcni/internal/testbed"
	"github.com/meshcni/meshcni/internal/testutil"
)

// The package installs Istio (and meshcni) once: the first test that needs it calls
// up, TestMain removes it after the last test (istio.Down) when the test bed outlives
// the test binary (one started by `hack/testbed up`); a test bed this binary started
// is stopped whole by testbed.RunMain.
var (
	upOnce   sync.Once
	upErr    error
	upInst   *istio.Installed
	upTook   time.Duration
	upRoot   string
	upNeeded bool
)

func TestMain(m *testing.M) {
	code := testbed.RunMain(m)
	if upNeeded {
		if err := downIfAttached(); err != nil {
			slog.Error("istio down", "err", err)
			if code == 0 {
				code = 1
			}
		}
	}
	os.Exit(code)
}

// downIfAttached removes Istio and meshcni from a test bed that is still running
// after the tests (one this binary attached to).
func downIfAttached() error {
	if _, _, ok := testbed.Running(); !ok {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	tb, err := testbed.Attach(ctx)
	if err != nil {
		return err
	}
	return istio.Down(ctx, tb, istio.Options{RepoRoot: upRoot})
}

// up returns the shared test bed with Istio and meshcni installed, installing them
// on first use. It skips (fails under CI=true) without root, go, ctr or the Istio
// build.
func up(t *testing.T) *testbed.Testbed {
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
		upInst, upErr = istio.Up(ctx, tb, istio.Options{RepoRoot: upRoot})
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

// useNamespace deletes the namespace (and waits until it is gone) when the test ends.
func useNamespace(t *testing.T, tb *testbed.Testbed, ns string) {
	t.Helper()
	t.Cleanup(func() {
		if err := istio.DeleteNamespace(context.Background(), tb, ns); err != nil {
			t.Error(err)
		}
	})
}
