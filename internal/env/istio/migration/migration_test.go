package migration

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/internal/env/istio"
	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/tools/build/image"
	"github.com/meshcni/meshcni/pkg/backend"
)

// The blocks of docs/migration.md the tests run.
const (
	forwardBlock  = "istio-cni-to-meshcni"
	rollbackBlock = "meshcni-to-istio-cni"
	loopInterval  = 2 * time.Second
)

// TestIstioCNIRedirects: Istio's own istio-cni, built from the pinned module and
// installed with Istio's istio-cni chart, is in the node's conflist without
// meshcni, and a meshed pod started then holds Istio's rules written by it (ISTIO_*
// iptables chains, exactly what Istio's contract asks, no meshcni tables); a real
// client → server connection is captured on 15001 and 15006.
func TestIstioCNIRedirects(t *testing.T) {
	tb := up(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	setCNI(ctx, t, tb, true, false)
	chain, err := istio.ChainTypes()
	if err != nil || !slices.Contains(chain, istio.CNIPluginType) || slices.Contains(chain, image.PluginCommand) {
		t.Fatalf("conflist plugins %q (%v): want istio-cni and not meshcni", chain, err)
	}
	app := startApp(ctx, t, tb, "istiocni-app")
	for _, p := range []string{app.Server.Name, app.Client.Name} {
		pod, err := tb.Client.CoreV1().Pods(app.Namespace).Get(ctx, p, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		a, err := audit(ctx, tb, pod)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s: rules held by %v (%s), drift %q", p, a.Kinds, a.By(), a.Drift)
		if !a.Redirected() || slices.Contains(a.Kinds, backend.Nftables) {
			t.Errorf("%s: kinds %v, drift %s: want Istio's rules in iptables ISTIO_* chains only", p, a.Kinds, a.Drift)
		}
	}
	appTraffic(ctx, t, tb, app, "istio-cni")
}

// TestMigrateIstioCNIToMeshcni: with Istio's istio-cni in the chain and a meshed
// client and server running, docs/migration.md's Helm procedure (block
// istio-cni-to-meshcni) runs as written while a loop starts a meshed pod every 2 s.
// Every pod that started holds exactly Istio's rules (by istio-cni, meshcni or
// both); the others did not start. The pods from before keep their traffic; after,
// the conflist holds meshcni and not istio-cni, and Istio's chart left nothing.
func TestMigrateIstioCNIToMeshcni(t *testing.T) {
	tb := up(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	setCNI(ctx, t, tb, true, false)
	importMeshcni(ctx, t, upRoot)
	app := startApp(ctx, t, tb, "mig-fwd-app")
	before := appTraffic(ctx, t, tb, app, "before the switch")

	pods := runSwitch(ctx, t, tb, "mig-fwd-loop", forwardBlock)
	judge(t, "istio-cni → meshcni", pods)

	waitChain(ctx, t, image.PluginCommand, istio.CNIPluginType)
	if err := istio.WaitIstioCNIGone(ctx, tb, time.Minute); err != nil {
		t.Error(err)
	}
	if _, err := tb.Client.CoreV1().ConfigMaps(istio.Namespace).Get(ctx, "istio-cni-config", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("after: ConfigMap istio-cni-config: %v, want NotFound (helm uninstall removes it)", err)
	}
	if after := appTraffic(ctx, t, tb, app, "after the switch"); after <= before {
		t.Errorf("after: the client proxy's outbound captures went from %d to %d", before, after)
	}
}

// TestRollbackMeshcniToIstioCNI: the reverse, docs/migration.md's block
// meshcni-to-istio-cni, under the same loop and audit; after, the conflist holds
// istio-cni and not meshcni, whose binary is gone from the node.
func TestRollbackMeshcniToIstioCNI(t *testing.T) {
	tb := up(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	setCNI(ctx, t, tb, false, true)
	app := startApp(ctx, t, tb, "mig-back-app")
	before := appTraffic(ctx, t, tb, app, "before the rollback")

	pods := runSwitch(ctx, t, tb, "mig-back-loop", rollbackBlock)
	judge(t, "meshcni → istio-cni", pods)

	waitChain(ctx, t, istio.CNIPluginType, image.PluginCommand)
	bin := filepath.Join(testbed.CNIBinDir, image.PluginCommand)
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(250 * time.Millisecond) {
		if _, err := os.Stat(bin); os.IsNotExist(err) {
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("after: %s is still there 30 s after meshcni's entry left the conflist", bin)
			break
		}
	}
	if after := appTraffic(ctx, t, tb, app, "after the rollback"); after <= before {
		t.Errorf("after: the client proxy's outbound captures went from %d to %d", before, after)
	}
}

// runSwitch starts the pod loop in ns, runs the doc block, lets the loop run 10 s
// more, and returns every pod the loop created, audited.
func runSwitch(ctx context.Context, t *testing.T, tb *testbed.Testbed, ns, block string) []*loopPod {
	t.Helper()
	injected(ctx, t, tb, ns)
	vf, err := istio.WriteCNIValues()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.Remove(vf) })
	b, err := istio.Lookup(ctx)
	if err != nil {
		t.Fatal(err)
	}
	subst := map[string]string{
		"istio/istiod":          b.Chart("istio-discovery"),
		"istio/cni":             b.Chart("istio-cni"),
		"deploy/charts/meshcni": filepath.Join(upRoot, "deploy", "charts", "meshcni"),
		"meshcni-values.yaml":   filepath.Join(upRoot, "deploy", "testbed-values.yaml"),
		"istio-cni-values.yaml": vf,
	}
	// The test bed's one adaptation: install-cni on the host network (istio.CNIHostNetwork).
	after := func(argv []string) error {
		if len(argv) > 3 && argv[0] == "helm" && argv[1] == "upgrade" && slices.Contains(argv, istio.CNIRelease) {
			return istio.CNIHostNetwork(ctx, tb)
		}
		return nil
	}
	l := startLoop(ctx, t, tb, ns, loopInterval)
	time.Sleep(2 * loopInterval) // pods created before the first command
	began := time.Now()
	steps, err := istio.RunDocBlock(ctx, istio.Options{RepoRoot: upRoot}, filepath.Join(upRoot, "docs", "migration.md"), block, subst, after)
	took := time.Since(began)
	for _, s := range steps {
		t.Logf("%8s  %s", s.Took.Round(time.Millisecond), strings.Join(s.Argv, " "))
	}
	if err != nil {
		l.finish()
		t.Fatalf("docs/migration.md block %s: %v", block, err)
	}
	t.Logf("block %s ran in %s", block, took.Round(time.Millisecond))
	time.Sleep(10 * time.Second)
	return l.finish()
}

// waitChain waits (1 minute at most) until the node's conflist holds plugin in and
// not plugin out (an agent removes its entry within its grace period).
func waitChain(ctx context.Context, t *testing.T, in, out string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for {
		chain, err := istio.ChainTypes()
		if err == nil && slices.Contains(chain, in) && !slices.Contains(chain, out) {
			t.Logf("after: conflist plugins %q", chain)
			return
		}
		select {
		case <-ctx.Done():
			t.Errorf("after: conflist plugins %q (%v): want %s and not %s", chain, err, in, out)
			return
		case <-time.After(250 * time.Millisecond):
		}
	}
}
