package deploy_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
)

// TestMultusStandalone installs the chart on a full test bed as on OpenShift with Multus
// (chained=false, provider=multus, cniConfDir a Multus-style directory apart from the
// node's primary configuration; Multus itself does not run here): the agent goes Ready
// with its own list there, network name istio-cni — what Istio's injector asks for
// (k8s.v1.cni.cncf.io/networks: default/istio-cni) — and leaves the primary configuration
// alone; the NetworkAttachmentDefinition default/istio-cni exists; helm uninstall removes
// the list. (Running the list as Multus runs an additional network is not shown: the
// plugin refuses an ADD without a prevResult, docs/install.md "Multus: what is proven".)
func TestMultusStandalone(t *testing.T) {
	testutil.RequireRoot(t)
	if _, err := testbed.Lookup(); err != nil {
		if errors.Is(err, testbed.ErrNotBuilt) {
			testutil.Missing(t, "%v", err)
		}
		t.Fatal(err)
	}
	helm := helmBinary(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	root, err := testbed.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	tb, err := testbed.Start(ctx, testbed.Options{ImageArchives: []string{builtImage(ctx, t, root).Out}})
	if errors.Is(err, testbed.ErrRunning) {
		testutil.Missing(t, "a shared test bed is running (hack/testbed up): stop it to run this test")
	}
	if err != nil {
		t.Fatalf("test bed: %v", err)
	}
	t.Cleanup(func() { _ = tb.Stop(context.Background()) })
	dyn, err := dynamic.NewForConfig(tb.RESTConfig)
	if err != nil {
		t.Fatal(err)
	}
	installCRD(ctx, t, dyn, "testdata/network-attachment-definition-crd.yaml")
	createNamespace(ctx, t, tb, installNamespace)

	// Multus' configuration directory stand-in (state of the test bed: removed by Stop).
	multusDir := filepath.Join(filepath.Dir(testbed.CNIConfDir), "multus-net.d")
	if err := os.MkdirAll(multusDir, 0o755); err != nil {
		t.Fatal(err)
	}
	primaryBefore := primaryConf(t)
	cmd := exec.CommandContext(ctx, helm, "install", release, chartDir, "--namespace", installNamespace, "--values", "testbed-values.yaml",
		"--set", "chained=false", "--set", "provider=multus", "--set", "cniConfDir="+multusDir,
		"--set", "repair.enabled=false", "--set", "taintController.enabled=false")
	cmd.Env = append(helmEnv(helmHome), "KUBECONFIG="+tb.Kubeconfig())
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("helm install: %v\n%s", err, out)
	}
	wctx, wcancel := context.WithTimeout(ctx, 2*time.Minute)
	defer wcancel()
	if _, err := tb.WaitDaemonSet(wctx, installNamespace, "meshcni-agent"); err != nil {
		t.Fatalf("agent: %v\n%s", err, diagnose(ctx, tb))
	}

	// The list: its own file, network name istio-cni, meshcni its one plugin.
	listPath := filepath.Join(multusDir, "meshcni.conflist")
	b, err := os.ReadFile(listPath)
	if err != nil {
		t.Fatal(err)
	}
	var list struct {
		Name    string `json:"name"`
		Plugins []struct {
			Type string `json:"type"`
		} `json:"plugins"`
	}
	if err := json.Unmarshal(b, &list); err != nil || list.Name != "istio-cni" || len(list.Plugins) != 1 || list.Plugins[0].Type != "meshcni" {
		t.Fatalf("%s: %v\n%s", listPath, err, b)
	}
	if after := primaryConf(t); after != primaryBefore {
		t.Errorf("the primary CNI configuration changed in standalone mode:\n%s\nwas\n%s", after, primaryBefore)
	}
	nad := schema.GroupVersionResource{Group: "k8s.cni.cncf.io", Version: "v1", Resource: "network-attachment-definitions"}
	if _, err := dyn.Resource(nad).Namespace("default").Get(ctx, "istio-cni", metav1.GetOptions{}); err != nil {
		t.Errorf("NetworkAttachmentDefinition default/istio-cni: %v", err)
	}

	cmd = exec.CommandContext(ctx, helm, "uninstall", release, "--namespace", installNamespace, "--wait")
	cmd.Env = append(helmEnv(helmHome), "KUBECONFIG="+tb.Kubeconfig())
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("helm uninstall: %v\n%s", err, out)
	}
	if err := poll(ctx, time.Minute, func() error {
		if n := agentPodNames(ctx, t, tb); len(n) > 0 {
			return fmt.Errorf("agent pods left: %v", n)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(listPath); !os.IsNotExist(err) {
		t.Errorf("%s after helm uninstall: %v", listPath, err)
	}
}

// primaryConf is the node's CNI configuration directory: file names and contents.
func primaryConf(t *testing.T) string {
	t.Helper()
	var b strings.Builder
	entries, err := os.ReadDir(testbed.CNIConfDir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		c, _ := os.ReadFile(filepath.Join(testbed.CNIConfDir, e.Name()))
		b.WriteString(e.Name() + ": " + string(c) + "\n")
	}
	return b.String()
}
