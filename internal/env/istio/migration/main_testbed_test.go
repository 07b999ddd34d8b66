package migration

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/meshcni/meshcni/internal/env/istio"
	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
)

// Istio (without meshcni) is installed once, by the first test. After the last test,
// a test bed this binary started stops with everything in it; from one it attached
// to (hack/testbed up), TestMain removes istio-cni, meshcni and Istio.
var (
	upOnce   sync.Once
	upErr    error
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
		o := istio.Options{RepoRoot: upRoot}
		err := errors.Join(istio.UninstallIstioCNI(ctx, tb, o), istio.Down(ctx, tb, o))
		if err != nil {
			return fmt.Errorf("istio-cni, meshcni and istio down: %w", err)
		}
		slog.Info("istio-cni, meshcni and istio removed", "took", time.Since(began).Round(time.Millisecond))
		return nil
	}))
}

// up returns the shared test bed with Istio installed (istiod with
// pilot.cni.enabled=true, no CNI yet). It skips (fails under CI=true) without root,
// go, ctr, kubectl or the Istio build.
func up(t testing.TB) *testbed.Testbed {
	t.Helper()
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "go")
	testutil.RequireBinary(t, "ctr")
	testutil.RequireBinary(t, "kubectl")
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
		var inst *istio.Installed
		inst, upErr = istio.Up(ctx, tb, istio.Options{RepoRoot: upRoot, SkipMeshcni: true})
		if inst != nil {
			for _, s := range inst.Steps {
				t.Logf("%8s  %s", s.Took.Round(time.Millisecond), s.Name)
			}
		}
	})
	if upErr != nil {
		t.Fatalf("istio up: %v", upErr)
	}
	return tb
}
