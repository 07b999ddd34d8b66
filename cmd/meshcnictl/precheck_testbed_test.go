package main

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/meshcni/meshcni/internal/env/demo"
	"github.com/meshcni/meshcni/internal/env/istio"
	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/buildinfo"
	"github.com/meshcni/meshcni/pkg/meshcnictl/agentversion"
	"github.com/meshcni/meshcni/pkg/meshcnictl/precheck"
)

const precheckNS = "precheck-e2e"

// istioRoot is the repository root once TestPrecheckVersionTestbed installed Istio
// (what it installs stays for the package's later tests).
var istioRoot string

// removeIstio runs after the package's tests (TestMain): a test bed this binary
// started stops with everything in it; from one it attached to (hack/testbed up) it
// removes what TestPrecheckVersionTestbed installed: its namespace, istio-cni, meshcni
// and Istio.
func removeIstio(tb *testbed.Testbed) error {
	if istioRoot == "" || tb.Owned() {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	_ = tb.Client.CoreV1().Namespaces().Delete(ctx, precheckNS, metav1.DeleteOptions{})
	o := istio.Options{RepoRoot: istioRoot}
	if err := istio.UninstallIstioCNI(ctx, tb, o); err != nil {
		return fmt.Errorf("istio-cni down: %w", err)
	}
	if err := istio.Down(ctx, tb, o); err != nil {
		return fmt.Errorf("istio down: %w", err)
	}
	return nil
}

// TestPrecheckVersionTestbed runs precheck and version against the real API server
// with Istio's istiod installed by its own chart (the real injector ConfigMap), then
// with meshcni installed by its chart: before meshcni, the node has no CNI redirect
// while the injector relies on one (a blocker); a revision whose injector renders
// istio-init is a blocker; meshed pods with istio-init or without istio-validation
// are named; with meshcni's agent Ready, the node blocker is gone; version reports
// the agent on the node (its /version, else its image).
func TestPrecheckVersionTestbed(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "go")
	testutil.RequireBinary(t, "ctr")
	ctx, cancel := context.WithTimeout(context.Background(), 12*time.Minute)
	defer cancel()
	if _, err := istio.Lookup(ctx); err != nil {
		testutil.Missing(t, "%v", err)
	}
	tb := testbed.Shared(t)
	root, err := testbed.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	istioRoot = root
	if _, err := istio.Up(ctx, tb, istio.Options{RepoRoot: root, SkipMeshcni: true}); err != nil {
		t.Fatalf("istio up: %v", err)
	}
	if err := tb.CreateNamespace(ctx, precheckNS); err != nil && !strings.Contains(err.Error(), "already exists") {
		t.Fatal(err)
	}
	// Meshed pods bound to a node that does not exist (never started): one with
	// istio-init, one with istio-validation, one with neither.
	for name, init := range map[string]string{"with-init": "istio-init", "validated": "istio-validation", "unchecked": ""} {
		p := echoPod(name, true)
		p.Namespace, p.Spec.NodeName = precheckNS, "node-b"
		if init != "" {
			p.Spec.InitContainers = []corev1.Container{{Name: init, Image: testbed.EchoImage, ImagePullPolicy: corev1.PullNever}}
		}
		if _, err := tb.CreatePod(ctx, p); err != nil {
			t.Fatal(err)
		}
	}
	// A revision whose injector renders istio-init: the real ConfigMap with
	// pilot.cni.enabled=false.
	real, err := tb.Client.CoreV1().ConfigMaps(istio.Namespace).Get(ctx, precheck.InjectorConfigMap, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	canary := real.DeepCopy()
	canary.ObjectMeta = metav1.ObjectMeta{Namespace: istio.Namespace, Name: precheck.InjectorConfigMap + "-canary", Labels: map[string]string{"istio.io/rev": "canary"}}
	var values map[string]any
	if err := json.Unmarshal([]byte(canary.Data["values"]), &values); err != nil {
		t.Fatalf("the real injector's values: %v", err)
	}
	values["revision"] = "canary"
	values["pilot"].(map[string]any)["cni"].(map[string]any)["enabled"] = false
	data, _ := json.Marshal(values)
	canary.Data["values"] = string(data)
	if _, err := tb.Client.CoreV1().ConfigMaps(istio.Namespace).Create(ctx, canary, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	kc := tb.Kubeconfig()
	wantImage := istio.Hub + "/proxyv2:" + istio.Tag
	r := precheckJSON(t, kc, exitBlockers)
	wantFindings(t, r,
		"BLOCKER  no CNI redirect is Ready on node "+testbed.NodeName,
		"BLOCKER  injector istio-system/istio-sidecar-injector-canary (revision canary): pilot.cni.enabled=false, pilot.cni.provider=default, proxy-init image "+wantImage,
		"INFO     injector istio-system/istio-sidecar-injector (revision default): pilot.cni.enabled=true, pilot.cni.provider=default, proxy-init image "+wantImage,
		"WARNING  1 meshed pod(s) carry the privileged istio-init, which wrote their rules itself: "+precheckNS+"/with-init",
		"WARNING  1 meshed pod(s) have no istio-validation init container: nothing checked their redirect when they started: "+precheckNS+"/unchecked",
		"INFO     Istio's istio-cni is not installed",
		"INFO     meshcni is not installed",
	)
	if r.Blockers != 2 || r.Meshcni != nil || r.IstioCNI != nil {
		t.Errorf("before meshcni: %d blockers, meshcni %+v, istio-cni %+v", r.Blockers, r.Meshcni, r.IstioCNI)
	}

	// Istio's istio-cni, installed by its own chart with its install-cni image: the
	// node is covered by it alone; the canary revision is the only blocker.
	if err := istio.InstallIstioCNI(ctx, tb, istio.Options{RepoRoot: root}); err != nil {
		t.Fatalf("install istio-cni: %v", err)
	}
	r = precheckJSON(t, kc, exitBlockers)
	wantFindings(t, r,
		"BLOCKER  injector istio-system/istio-sidecar-injector-canary",
		"INFO     Istio's istio-cni is installed: DaemonSet "+istio.Namespace+"/"+istio.CNIDaemonSet+", Ready on node "+testbed.NodeName,
		"INFO     only istio-cni redirects on node "+testbed.NodeName+"  => install meshcni and wait for its agent to be Ready there before removing istio-cni",
		"INFO     meshcni is not installed",
	)
	if r.Blockers != 1 || r.IstioCNI == nil || !slices.Equal(r.IstioCNI.ReadyNodes, []string{testbed.NodeName}) || len(r.IstioCNI.NotReadyNodes) != 0 || r.Meshcni != nil {
		t.Errorf("with istio-cni: %d blockers, istio-cni %+v, meshcni %+v", r.Blockers, r.IstioCNI, r.Meshcni)
	}

	// meshcni installed by its chart next to istio-cni: both cover the node; once
	// istio-cni is gone, meshcni alone; the canary revision is the only blocker, and
	// none once it is gone.
	if _, err := demo.Install(ctx, tb, demo.Options{RepoRoot: root, Keep: true}); err != nil {
		t.Fatalf("install meshcni: %v", err)
	}
	r = precheckJSON(t, kc, exitBlockers)
	wantFindings(t, r, "INFO     istio-cni and meshcni are both Ready on node "+testbed.NodeName+": a new pod is redirected by both")
	if r.Blockers != 1 || r.IstioCNI == nil || r.Meshcni == nil || len(r.Meshcni.ReadyNodes) != 1 {
		t.Errorf("with istio-cni and meshcni: %d blockers, istio-cni %+v, meshcni %+v", r.Blockers, r.IstioCNI, r.Meshcni)
	}
	if err := istio.UninstallIstioCNI(ctx, tb, istio.Options{RepoRoot: root}); err != nil {
		t.Fatalf("uninstall istio-cni: %v", err)
	}
	r = precheckJSON(t, kc, exitBlockers)
	wantFindings(t, r, "BLOCKER  injector istio-system/istio-sidecar-injector-canary", "INFO     only meshcni redirects on node "+testbed.NodeName)
	if r.Blockers != 1 || r.Meshcni == nil || len(r.Meshcni.ReadyNodes) != 1 || r.Meshcni.Chained == nil || !*r.Meshcni.Chained || r.IstioCNI != nil {
		t.Errorf("with meshcni: %d blockers, meshcni %+v", r.Blockers, r.Meshcni)
	}
	if err := tb.Client.CoreV1().ConfigMaps(istio.Namespace).Delete(ctx, canary.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	out, code, err := ctl(t, "precheck", "--kubeconfig", kc)
	t.Logf("meshcnictl precheck (exit %d):\n%s", code, out)
	if code != 0 || err != nil || !strings.HasSuffix(out, "0 blocker(s), 2 warning(s)\n") {
		t.Errorf("without the canary: exit %d, %v", code, err)
	}

	testMultus(t, tb, real)
	testVersionAgents(t, kc)
	testNamespaceFromContext(t, kc)
}

var (
	crdGVR = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}
	nadGVR = schema.GroupVersionResource{Group: "k8s.cni.cncf.io", Version: "v1", Resource: "network-attachment-definitions"}
)

// testMultus: a revision whose injector uses Multus (the real ConfigMap with
// pilot.cni.provider=multus: the network comes from Istio's real sidecar template),
// first without Multus' CRD, then with Istio's chart's NetworkAttachmentDefinition,
// then without it.
func testMultus(t *testing.T, tb *testbed.Testbed, real *corev1.ConfigMap) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cms := tb.Client.CoreV1().ConfigMaps(istio.Namespace)
	cm := real.DeepCopy()
	cm.ObjectMeta = metav1.ObjectMeta{Namespace: istio.Namespace, Name: precheck.InjectorConfigMap + "-multus", Labels: map[string]string{"istio.io/rev": "multus"}}
	var values map[string]any
	if err := json.Unmarshal([]byte(cm.Data["values"]), &values); err != nil {
		t.Fatal(err)
	}
	values["revision"] = "multus"
	values["pilot"].(map[string]any)["cni"].(map[string]any)["provider"] = "multus"
	data, _ := json.Marshal(values)
	cm.Data["values"] = string(data)
	if _, err := cms.Create(ctx, cm, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cms.Delete(context.Background(), cm.Name, metav1.DeleteOptions{}) })
	inj := "injector istio-system/" + cm.Name
	r := precheckJSON(t, tb.Kubeconfig(), 0)
	wantFindings(t, r,
		"WARNING  "+inj+" asks Multus for network default/istio-cni but meshcni is chained into the primary network",
		"WARNING  "+inj+" asks Multus for network default/istio-cni but the API server serves no NetworkAttachmentDefinitions",
		"INFO     "+inj+" (revision multus): pilot.cni.enabled=true, pilot.cni.provider=multus, proxy-init image "+istio.Hub+"/proxyv2:"+istio.Tag+", Multus network default/istio-cni:",
	)

	dyn, err := dynamic.NewForConfig(tb.RESTConfig)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := dyn.Resource(crdGVR).Create(ctx, nadCRD(), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = dyn.Resource(crdGVR).Delete(context.Background(), "network-attachment-definitions.k8s.cni.cncf.io", metav1.DeleteOptions{})
	})
	// As Istio's istio-cni chart renders it (provider multus): no spec.config.
	nad := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "k8s.cni.cncf.io/v1", "kind": "NetworkAttachmentDefinition",
		"metadata": map[string]any{"name": "istio-cni", "namespace": "default",
			"labels": map[string]any{"operator.istio.io/component": "Cni", "app.kubernetes.io/name": "istio-cni"}},
	}}
	var created bool
	for !created { // the CRD is served shortly after it is created
		_, err := dyn.Resource(nadGVR).Namespace("default").Create(ctx, nad, metav1.CreateOptions{})
		switch {
		case err == nil:
			created = true
		case ctx.Err() != nil:
			t.Fatalf("create the NetworkAttachmentDefinition: %v", err)
		default:
			time.Sleep(200 * time.Millisecond)
		}
	}
	r = precheckJSON(t, tb.Kubeconfig(), 0)
	wantFindings(t, r, "WARNING  NetworkAttachmentDefinition default/istio-cni belongs to Istio's istio-cni chart")
	if err := dyn.Resource(nadGVR).Namespace("default").Delete(ctx, "istio-cni", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	r = precheckJSON(t, tb.Kubeconfig(), exitBlockers)
	wantFindings(t, r, "BLOCKER  injected pods name Multus network default/istio-cni but no NetworkAttachmentDefinition default/istio-cni exists")
	if err := cms.Delete(ctx, cm.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
}

// nadCRD is Multus' NetworkAttachmentDefinition CRD (its schema as Multus ships it:
// spec.config a string).
func nadCRD() *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
		"metadata": map[string]any{"name": "network-attachment-definitions.k8s.cni.cncf.io"},
		"spec": map[string]any{
			"group": "k8s.cni.cncf.io", "scope": "Namespaced",
			"names": map[string]any{"plural": "network-attachment-definitions", "singular": "network-attachment-definition",
				"kind": "NetworkAttachmentDefinition", "shortNames": []any{"net-attach-def"}},
			"versions": []any{map[string]any{"name": "v1", "served": true, "storage": true,
				"schema": map[string]any{"openAPIV3Schema": map[string]any{"type": "object", "properties": map[string]any{
					"apiVersion": map[string]any{"type": "string"}, "kind": map[string]any{"type": "string"},
					"metadata": map[string]any{"type": "object"},
					"spec":     map[string]any{"type": "object", "properties": map[string]any{"config": map[string]any{"type": "string"}}},
				}}}}},
		},
	}}
}

func precheckJSON(t *testing.T, kubeconfig string, wantCode int) precheckReport {
	t.Helper()
	out, code, err := ctl(t, "precheck", "--kubeconfig", kubeconfig, "-o", "json")
	var r precheckReport
	if jerr := json.Unmarshal([]byte(out), &r); jerr != nil {
		t.Fatalf("precheck -o json (exit %d, %v): %v\n%s", code, err, jerr, out)
	}
	var lines []string
	for _, f := range r.Findings {
		lines = append(lines, f.String())
	}
	t.Logf("meshcnictl precheck (exit %d):\n%s", code, strings.Join(lines, "\n"))
	if code != wantCode || r.Kind != precheckKind || r.APIVersion != "meshcni.io/v1alpha1" {
		t.Fatalf("precheck: exit %d (%v), kind %q; want exit %d", code, err, r.Kind, wantCode)
	}
	return r
}

// wantFindings checks that each want starts a finding's line.
func wantFindings(t *testing.T, r precheckReport, want ...string) {
	t.Helper()
	for _, w := range want {
		found := false
		for _, f := range r.Findings {
			found = found || strings.HasPrefix(f.String(), w)
		}
		if !found {
			t.Errorf("no finding %q", w)
		}
	}
}

// testVersionAgents: version finds the chart's agent pod on the node and reports
// the version the agent itself serves on GET /version (pkg/buildinfo), through the
// API server's pods proxy: demo.Install built its image here with tag and
// main.version "dev", with this test's Go toolchain, for this host's architecture.
func testVersionAgents(t *testing.T, kubeconfig string) {
	out, code, err := ctl(t, "version", "--kubeconfig", kubeconfig, "-o", "json")
	if code != 0 || err != nil {
		t.Fatalf("version: exit %d, %v\n%s", code, err, out)
	}
	var r versionReport
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		t.Fatal(err)
	}
	if len(r.Agents) != 1 {
		t.Fatalf("version: %d agents, want 1:\n%s", len(r.Agents), out)
	}
	a := r.Agents[0]
	want := buildinfo.Info{Version: "dev", GoVersion: runtime.Version(), Platform: "linux/" + runtime.GOARCH}
	if got := (buildinfo.Info{Version: a.Version, GoVersion: a.GoVersion, Platform: a.Platform}); a.Source != agentversion.FromAgent || got != want || a.Note != "" {
		t.Errorf("version: agent %+v; want source %q and %+v from its GET /version", a, agentversion.FromAgent, want)
	}
	if a.Node != testbed.NodeName || !strings.HasSuffix(a.Image, "/meshcni:dev") {
		t.Errorf("version: %+v", a)
	}
	text, _, _ := ctl(t, "version", "--kubeconfig", kubeconfig)
	t.Logf("meshcnictl version:\n%s", text)
	if !strings.Contains(text, "node "+testbed.NodeName+": meshcni-agent dev ("+want.GoVersion+", "+want.Platform+") pod ") {
		t.Errorf("version text:\n%s", text)
	}
}

// testNamespaceFromContext: explain POD without -n reads the pod from the
// kubeconfig context's namespace.
func testNamespaceFromContext(t *testing.T, kubeconfig string) {
	cfg, err := clientcmd.LoadFromFile(kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Contexts[cfg.CurrentContext].Namespace = precheckNS
	kc := filepath.Join(t.TempDir(), "kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, kc); err != nil {
		t.Fatal(err)
	}
	out, code, err := ctl(t, "explain", "--kubeconfig", kc, "unchecked")
	if code != 0 || err != nil || !strings.Contains(out, "pod:      "+precheckNS+"/unchecked\ndecision: redirected") {
		t.Errorf("explain unchecked in the context's namespace: exit %d, %v\n%s", code, err, out)
	}
}
