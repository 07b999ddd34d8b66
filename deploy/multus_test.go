package deploy_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"

	"github.com/meshcni/meshcni/internal/build/image"
	"github.com/meshcni/meshcni/internal/testbed"
	"github.com/meshcni/meshcni/internal/testutil"
	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/engine"
	"github.com/meshcni/meshcni/pkg/podspec"
	"github.com/meshcni/meshcni/pkg/podspec/corepod"
)

// multusNamespace holds the meshed pod of TestMultusStandalone.
const multusNamespace = "meshcni-multus-test"

// TestMultusStandalone installs the chart on a full test bed as on OpenShift with Multus
// (chained=false, provider=multus, cniConfDir a Multus-style directory apart from the
// node's primary configuration; Multus itself does not run here): the agent writes its
// own list there, network name istio-cni — what Istio's injector asks for
// (k8s.v1.cni.cncf.io/networks: default/istio-cni) — and leaves the primary configuration
// alone; the NetworkAttachmentDefinition default/istio-cni exists; a meshed pod started
// by the primary network alone has no redirect; running the list as Multus runs an
// additional network (libcni ADD in the pod's netns with its K8S_* arguments, interface
// net1) writes the pod's whole redirect; DEL removes it.
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
	archive := filepath.Join(t.TempDir(), "meshcni.tar")
	if _, err := image.Build(ctx, image.Options{RepoRoot: root, Hub: image.DefaultHub, Tag: image.DefaultTag, Out: archive, WorkDir: t.TempDir()}); err != nil {
		t.Fatalf("build the image: %v", err)
	}
	tb, err := testbed.Start(ctx, testbed.Options{ImageArchives: []string{archive}})
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
	createNamespace(ctx, t, tb, multusNamespace)

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

	// A meshed pod, through the primary network only: no redirect yet.
	p := meshedPod("multus-meshed")
	p.Namespace = multusNamespace
	if _, err := tb.CreatePod(ctx, p); err != nil {
		t.Fatal(err)
	}
	pod, err := tb.WaitPodReady(ctx, multusNamespace, p.Name)
	if err != nil {
		t.Fatal(err)
	}
	netns, err := tb.PodNetns(ctx, multusNamespace, p.Name)
	if err != nil {
		t.Fatal(err)
	}
	s, err := podspec.Spec(corepod.From(pod))
	if err != nil {
		t.Fatal(err)
	}
	var ips []netip.Addr
	for _, ip := range pod.Status.PodIPs {
		ips = append(ips, netip.MustParseAddr(ip.IP))
	}
	podspec.WithFamilies(s, ips)
	check := func(what string, redirected bool) {
		t.Helper()
		d, err := engine.Check(ctx, engine.Options{Backend: backend.Auto, NetnsPath: netns}, s)
		if err != nil {
			t.Fatalf("%s: check: %v", what, err)
		}
		if d.Empty() != redirected {
			t.Fatalf("%s: redirected %v, want %v (%d rules missing, %d unexpected)", what, d.Empty(), redirected, len(d.Missing), len(d.Unexpected))
		}
	}
	check("primary network only", false)

	// What Multus does for the additional network default/istio-cni: the list found by its
	// network name, run in the pod's netns with the pod's identity.
	conf, err := libcni.ConfListFromFile(listPath)
	if err != nil {
		t.Fatal(err)
	}
	cni := libcni.NewCNIConfig([]string{testbed.CNIBinDir}, nil)
	rt := &libcni.RuntimeConf{
		ContainerID: "multus-" + string(pod.UID), NetNS: netns, IfName: "net1",
		Args: [][2]string{{"IgnoreUnknown", "1"}, {"K8S_POD_NAMESPACE", multusNamespace}, {"K8S_POD_NAME", p.Name}, {"K8S_POD_INFRA_CONTAINER_ID", "multus-" + string(pod.UID)}},
	}
	if _, err := cni.AddNetworkList(ctx, conf, rt); err != nil {
		t.Fatalf("ADD of network %s: %v", conf.Name, err)
	}
	check("after ADD of network istio-cni", true)
	if err := cni.DelNetworkList(ctx, conf, rt); err != nil {
		t.Fatalf("DEL of network %s: %v", conf.Name, err)
	}
	check("after DEL", false)
	t.Logf("network %s from %s: ADD wrote the redirect of %s/%s, DEL removed it", conf.Name, strings.TrimPrefix(listPath, filepath.Dir(multusDir)+"/"), multusNamespace, p.Name)

	cmd = exec.CommandContext(ctx, helm, "uninstall", release, "--namespace", installNamespace, "--wait")
	cmd.Env = append(helmEnv(helmHome), "KUBECONFIG="+tb.Kubeconfig())
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("helm uninstall: %v\n%s", err, out)
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
