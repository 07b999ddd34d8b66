package deploy_test

// The chart's identities and admission policies on a real kube-apiserver (the test
// bed's API-only mode): the RBAC objects and ValidatingAdmissionPolicies are the chart's
// own, rendered by helm and applied; the credentials are real tokens minted by the API
// server for the chart's ServiceAccounts, bound to Pods on (fake) Nodes as a kubelet's
// would be. Each attack is first shown to work without the fix, then to fail with it.

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	authv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/agent"
	"github.com/meshcni/meshcni/pkg/install"
	"github.com/meshcni/meshcni/pkg/repair"
	"github.com/meshcni/meshcni/pkg/taint"
)

const (
	idNS      = "meshcni-identity-test" // the release namespace
	victimNS  = "identity-victims"      // workloads
	nodeA     = "identity-node-a"       // the agent's node
	nodeB     = "identity-node-b"       // another node
	agentPod  = "meshcni-agent-a"
	taintPod  = "meshcni-taint-controller-x"
	nodeExtra = "authentication.kubernetes.io/node-name"
)

// idEnv is the test's API server, the chart's objects applied, and helpers.
type idEnv struct {
	t      *testing.T
	ctx    context.Context
	tb     *testbed.Testbed
	admin  kubernetes.Interface
	dyn    dynamic.Interface
	mapper meta.RESTMapper
}

func newIDEnv(t *testing.T) *idEnv {
	t.Helper()
	testutil.RequireRoot(t)
	if _, err := testbed.Lookup(); err != nil {
		if errors.Is(err, testbed.ErrNotBuilt) {
			testutil.Missing(t, "%v", err)
		}
		t.Fatal(err)
	}
	helmBinary(t)
	if _, pid, ok := testbed.Running(); ok {
		testutil.Missing(t, "a shared test bed (pid %d) is running; this test creates fake Nodes and cluster-wide policies and needs its own API server", pid)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	t.Cleanup(cancel)
	tb, err := testbed.Start(ctx, testbed.Options{APIOnly: true, Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	if err != nil {
		t.Fatalf("API-only test bed: %v", err)
	}
	t.Cleanup(func() { _ = tb.Stop(context.Background()) })
	dc, err := discovery.NewDiscoveryClientForConfig(tb.RESTConfig)
	if err != nil {
		t.Fatal(err)
	}
	groups, err := restmapper.GetAPIGroupResources(dc)
	if err != nil {
		t.Fatal(err)
	}
	dyn, err := dynamic.NewForConfig(tb.RESTConfig)
	if err != nil {
		t.Fatal(err)
	}
	e := &idEnv{t: t, ctx: ctx, tb: tb, admin: tb.Client, dyn: dyn, mapper: restmapper.NewDiscoveryRESTMapper(groups)}
	for _, ns := range []string{idNS, victimNS} {
		if err := tb.CreateNamespace(ctx, ns); err != nil {
			t.Fatal(err)
		}
	}
	return e
}

// applyChart renders the chart into idNS with values and applies the kinds given (a
// real server-side apply, not a dry run).
func (e *idEnv) applyChart(values []string, kinds ...string) {
	e.t.Helper()
	_, objs := render(e.t, idNS, values)
	want := map[string]bool{}
	for _, k := range kinds {
		want[k] = true
	}
	n := 0
	for _, o := range objs {
		if !want[o.GetKind()] {
			continue
		}
		if err := e.apply(o); err != nil {
			e.t.Fatalf("apply %s %s: %v", o.GetKind(), o.GetName(), err)
		}
		n++
	}
	if n == 0 {
		e.t.Fatalf("no object of kinds %v rendered with %v", kinds, values)
	}
}

func (e *idEnv) apply(o *unstructured.Unstructured) error {
	_, err := serverSideApply(e.ctx, e.dyn, e.mapper, o, metav1.PatchOptions{FieldManager: "meshcni-identity-test"})
	return err
}

func (e *idEnv) node(name string) {
	e.t.Helper()
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"meshcni.test/identity": "true"}}}
	if _, err := e.admin.CoreV1().Nodes().Create(e.ctx, n, metav1.CreateOptions{}); err != nil {
		e.t.Fatal(err)
	}
}

func (e *idEnv) pod(ns, name, sa, node string, labels map[string]string) *corev1.Pod {
	e.t.Helper()
	no := false
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: labels},
		Spec: corev1.PodSpec{
			NodeName: node, ServiceAccountName: sa, AutomountServiceAccountToken: &no,
			Containers: []corev1.Container{{Name: "c", Image: "meshcni.local/none:dev"}},
		},
	}
	out, err := e.admin.CoreV1().Pods(ns).Create(e.ctx, p, metav1.CreateOptions{})
	if err != nil {
		e.t.Fatal(err)
	}
	return out
}

// token mints a token of ServiceAccount idNS/sa, bound to pod (in idNS) unless pod is "".
func (e *idEnv) token(sa, pod string) string {
	e.t.Helper()
	exp := int64(600)
	tr := &authv1.TokenRequest{Spec: authv1.TokenRequestSpec{ExpirationSeconds: &exp}}
	if pod != "" {
		tr.Spec.BoundObjectRef = &authv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod}
	}
	out, err := e.admin.CoreV1().ServiceAccounts(idNS).CreateToken(e.ctx, sa, tr, metav1.CreateOptions{})
	if err != nil {
		e.t.Fatalf("TokenRequest for %s: %v", sa, err)
	}
	return out.Status.Token
}

// clientFor is a client that authenticates with token.
func (e *idEnv) clientFor(token string) kubernetes.Interface {
	e.t.Helper()
	cfg := &rest.Config{Host: e.tb.RESTConfig.Host, BearerToken: token, TLSClientConfig: rest.TLSClientConfig{CAData: e.tb.RESTConfig.CAData}}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	return cs
}

// caFile writes the API server's CA into a file, as the agent pod's ca.crt.
func (e *idEnv) caFile() string {
	e.t.Helper()
	p := filepath.Join(e.t.TempDir(), "ca.crt")
	if err := os.WriteFile(p, e.tb.RESTConfig.CAData, 0o644); err != nil {
		e.t.Fatal(err)
	}
	return p
}

// inCluster is the API server's address as the agent's in-cluster source sees it.
func (e *idEnv) inCluster(tokenFile string) *install.InCluster {
	e.t.Helper()
	host, port, _ := strings.Cut(strings.TrimPrefix(e.tb.RESTConfig.Host, "https://"), ":")
	getenv := func(k string) string {
		return map[string]string{"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port}[k]
	}
	ic, err := install.InClusterFromEnv(getenv, tokenFile, e.caFile())
	if err != nil {
		e.t.Fatal(err)
	}
	return ic
}

// kubeconfigClient writes the plugin's kubeconfig from src as the agent does and
// returns a client reading it back.
func (e *idEnv) kubeconfigClient(src install.KubeconfigSource) kubernetes.Interface {
	e.t.Helper()
	k := &install.Kubeconfig{Source: src, Path: filepath.Join(e.t.TempDir(), agent.KubeconfigName)}
	if _, err := k.Install(); err != nil {
		e.t.Fatal(err)
	}
	if err := k.Check(); err != nil {
		e.t.Fatal(err)
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", k.Path)
	if err != nil {
		e.t.Fatal(err)
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	return cs
}

// labelPatch is the repair controller's action label, byte for byte
// (pkg/repair controller.go act).
func labelPatch(t *testing.T, key string, uid types.UID) []byte {
	t.Helper()
	b, err := json.Marshal(map[string]any{"metadata": map[string]any{
		"labels": map[string]string{key: repair.LabelValue},
		"uid":    uid,
	}})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func mergePatch(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// taintPatchOf is the taint controller's patch, as pkg/taint setTaint builds it: the
// node's taints with or without the managed one, guarded by its resourceVersion.
func taintPatchOf(t *testing.T, n *corev1.Node, taints []corev1.Taint) []byte {
	t.Helper()
	var p struct {
		Metadata struct {
			ResourceVersion string `json:"resourceVersion"`
		} `json:"metadata"`
		Spec struct {
			Taints []corev1.Taint `json:"taints"`
		} `json:"spec"`
	}
	p.Metadata.ResourceVersion = n.ResourceVersion
	if len(taints) > 0 {
		p.Spec.Taints = taints
	}
	return mergePatch(t, p)
}

func patchPod(ctx context.Context, cs kubernetes.Interface, p *corev1.Pod, body []byte, dry bool) error {
	opts := metav1.PatchOptions{}
	if dry {
		opts.DryRun = []string{metav1.DryRunAll}
	}
	_, err := cs.CoreV1().Pods(p.Namespace).Patch(ctx, p.Name, types.MergePatchType, body, opts)
	return err
}

func patchNode(ctx context.Context, cs kubernetes.Interface, name string, body []byte) error {
	_, err := cs.CoreV1().Nodes().Patch(ctx, name, types.MergePatchType, body, metav1.PatchOptions{FieldManager: taint.Component})
	return err
}

// denied checks that err is the admission policy's refusal carrying msg.
func denied(t *testing.T, what string, err error, msg ...string) {
	t.Helper()
	if err == nil {
		t.Errorf("%s: admitted, want denied by the admission policy", what)
		return
	}
	if !apierrors.IsInvalid(err) && !apierrors.IsForbidden(err) {
		t.Errorf("%s: %v, want the admission policy's denial", what, err)
		return
	}
	if !strings.Contains(err.Error(), "ValidatingAdmissionPolicy") {
		t.Errorf("%s: %v, want a ValidatingAdmissionPolicy denial", what, err)
	}
	for _, m := range msg {
		if !strings.Contains(err.Error(), m) {
			t.Errorf("%s: %v, want it to say %q", what, err, m)
		}
	}
	t.Logf("%s: denied: %v", what, err)
}

func forbidden(t *testing.T, what string, err error) {
	t.Helper()
	if !apierrors.IsForbidden(err) {
		t.Errorf("%s: %v, want Forbidden by RBAC", what, err)
	}
}

func allowed(t *testing.T, what string, err error) {
	t.Helper()
	if err != nil {
		t.Errorf("%s: %v, want it allowed", what, err)
	}
}

// whoAmI is the API server's view of a client's user (SelfSubjectReview).
func whoAmI(ctx context.Context, t *testing.T, cs kubernetes.Interface) authv1.UserInfo {
	t.Helper()
	r, err := cs.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return r.Status.UserInfo
}

// TestPluginIdentity: the kubeconfig the agent writes for the plugin. Before: it held
// the agent's own token, with which root on one node lists every pod of the cluster
// and (repair action label) patches a pod on another node. Now: a token of the
// chart's <release>-plugin ServiceAccount, minted by the agent with the chart's RBAC,
// which may only get a pod: list, patch, delete, secrets and minting tokens are
// Forbidden.
func TestPluginIdentity(t *testing.T) {
	e := newIDEnv(t)
	ctx := e.ctx
	// Unfenced patch, by name: the "before" attack patches a pod on another node.
	label := []string{"repair.action=label", "admissionPolicies.enabled=false", "rbac.unfencedPodWrites={patch}"}
	e.applyChart(label, "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
	e.node(nodeA)
	e.node(nodeB)
	e.pod(idNS, agentPod, "meshcni-agent", nodeA, nil)
	victim := e.pod(victimNS, "victim-b", "default", nodeB, map[string]string{"app": "victim"})
	agentToken := e.token("meshcni-agent", agentPod)
	agentCS := e.clientFor(agentToken)

	t.Run("before: the agent's own token in the plugin kubeconfig", func(t *testing.T) {
		tokFile := filepath.Join(t.TempDir(), "token")
		if err := os.WriteFile(tokFile, []byte(agentToken), 0o600); err != nil {
			t.Fatal(err)
		}
		stolen := e.kubeconfigClient(e.inCluster(tokFile))
		pods, err := stolen.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
		allowed(t, "list every pod with the stolen kubeconfig", err)
		if err == nil {
			t.Logf("attack reproduced: the old plugin kubeconfig lists %d pods of every namespace", len(pods.Items))
		}
		err = patchPod(ctx, stolen, victim, mergePatch(t, map[string]any{"metadata": map[string]any{"labels": map[string]string{"owned": "true"}}}), false)
		allowed(t, "patch a pod on another node with the stolen kubeconfig", err)
	})

	t.Run("now: the plugin's own ServiceAccount", func(t *testing.T) {
		holder := &install.Minted{API: e.inCluster("/nonexistent/token")}
		pt := &agent.PluginToken{TokenMinter: install.TokenMinter{Client: agentCS, Namespace: idNS, ServiceAccount: "meshcni-plugin", NodeName: nodeA, Expiration: time.Hour}, Holder: holder}
		exp, err := pt.Mint(ctx)
		if err != nil {
			t.Fatalf("the agent mints the plugin's token with the chart's RBAC: %v", err)
		}
		if life := time.Until(exp); life < 50*time.Minute || life > 61*time.Minute {
			t.Errorf("token lifetime %v, want the 1h asked", life)
		}
		plugin := e.kubeconfigClient(holder)
		u := whoAmI(ctx, t, plugin)
		if u.Username != "system:serviceaccount:"+idNS+":meshcni-plugin" {
			t.Errorf("plugin user %q", u.Username)
		}
		if _, ok := u.Extra["authentication.kubernetes.io/pod-name"]; ok {
			t.Errorf("plugin token bound to a pod: %v", u.Extra)
		}
		if got := u.Extra[nodeExtra]; len(got) != 1 || got[0] != nodeA {
			t.Errorf("plugin token node %v, want %s", got, nodeA)
		}
		_, err = plugin.CoreV1().Pods(victimNS).Get(ctx, victim.Name, metav1.GetOptions{})
		allowed(t, "get a pod (the plugin's one need)", err)
		_, err = plugin.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
		forbidden(t, "list pods", err)
		_, err = plugin.CoreV1().Pods(victimNS).List(ctx, metav1.ListOptions{})
		forbidden(t, "list pods in a namespace", err)
		forbidden(t, "patch a pod", patchPod(ctx, plugin, victim, mergePatch(t, map[string]any{"metadata": map[string]any{"labels": map[string]string{"owned": "again"}}}), false))
		forbidden(t, "delete a pod", plugin.CoreV1().Pods(victimNS).Delete(ctx, victim.Name, metav1.DeleteOptions{}))
		_, err = plugin.CoreV1().Secrets(idNS).Get(ctx, "anything", metav1.GetOptions{})
		forbidden(t, "get a secret", err)
		_, err = plugin.CoreV1().ServiceAccounts(idNS).CreateToken(ctx, "meshcni-agent", &authv1.TokenRequest{}, metav1.CreateOptions{})
		forbidden(t, "mint the agent's token", err)
	})

	t.Run("the agent mints tokens for the plugin's ServiceAccount only", func(t *testing.T) {
		for _, sa := range []string{"meshcni-agent", "meshcni-taint-controller", "default"} {
			_, err := agentCS.CoreV1().ServiceAccounts(idNS).CreateToken(ctx, sa, &authv1.TokenRequest{}, metav1.CreateOptions{})
			forbidden(t, "agent mints a token of "+sa, err)
		}
	})
}

// TestAdmissionFencing: the chart's ValidatingAdmissionPolicies. Each attack runs first
// without them (admitted), then with them (denied with the policy's message); what the
// repair and taint controllers and the agent's redirected marker really send is
// admitted.
func TestAdmissionFencing(t *testing.T) {
	e := newIDEnv(t)
	ctx := e.ctx
	rbac := []string{"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
	e.applyChart([]string{"repair.action=label", "admissionPolicies.enabled=false", "rbac.unfencedPodWrites={patch}"}, rbac...)
	e.node(nodeA)
	e.node(nodeB)
	e.pod(idNS, agentPod, "meshcni-agent", nodeA, nil)
	e.pod(idNS, taintPod, "meshcni-taint-controller", nodeB, nil)
	victimA := e.pod(victimNS, "victim-a", "default", nodeA, map[string]string{"app": "victim"})
	victimB := e.pod(victimNS, "victim-b", "default", nodeB, map[string]string{"app": "victim"})
	agentCS := e.clientFor(e.token("meshcni-agent", agentPod))
	unboundAgentCS := e.clientFor(e.token("meshcni-agent", ""))
	taintCS := e.clientFor(e.token("meshcni-taint-controller", taintPod))

	// The API server names the node of a pod-bound token in the user's extra: the
	// policy's ground truth.
	if got := whoAmI(ctx, t, agentCS).Extra[nodeExtra]; len(got) != 1 || got[0] != nodeA {
		t.Fatalf("agent token bound to a pod on %s: extra %s = %v", nodeA, nodeExtra, got)
	}
	if got, ok := whoAmI(ctx, t, unboundAgentCS).Extra[nodeExtra]; ok {
		t.Fatalf("unbound token: extra %s = %v", nodeExtra, got)
	}
	key := repair.DefaultLabelKey
	otherLabel := mergePatch(t, map[string]any{"metadata": map[string]any{"labels": map[string]string{"app": "owned"}}})
	nodeLabel := mergePatch(t, map[string]any{"metadata": map[string]any{"labels": map[string]string{"owned": "true"}}})

	// Before: the attacks work.
	allowed(t, "before: agent patches a pod on another node", patchPod(ctx, agentCS, victimB, otherLabel, true))
	allowed(t, "before: agent patches another label on its node", patchPod(ctx, agentCS, victimA, otherLabel, true))
	allowed(t, "before: taint controller labels a node", patchNode(ctx, taintCS, nodeA, nodeLabel))
	if err := patchNode(ctx, e.admin, nodeA, mergePatch(t, map[string]any{"metadata": map[string]any{"labels": map[string]any{"owned": nil}}})); err != nil {
		t.Fatal(err)
	}

	e.applyChart([]string{"repair.action=label"}, "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
	// Policies load asynchronously: wait until the cross-node patch (dry run) is denied.
	if err := poll(ctx, time.Minute, func() error {
		if patchPod(ctx, agentCS, victimB, otherLabel, true) == nil {
			return errors.New("still admitted")
		}
		return nil
	}); err != nil {
		t.Fatalf("the agent policy never took effect: %v", err)
	}

	t.Run("agent patch", func(t *testing.T) {
		denied(t, "repair's label on a pod of another node", patchPod(ctx, agentCS, victimB, labelPatch(t, key, victimB.UID), false),
			"on node "+nodeA+" may change or delete only pods of its own node", "is on node "+nodeB)
		denied(t, "another label on its own node", patchPod(ctx, agentCS, victimA, otherLabel, false), "may change only the label "+key)
		denied(t, "an annotation on its own node", patchPod(ctx, agentCS, victimA, mergePatch(t, map[string]any{"metadata": map[string]any{"annotations": map[string]string{"x": "y"}}}), false), "may change only the label")
		denied(t, "its label with another value", patchPod(ctx, agentCS, victimA, mergePatch(t, map[string]any{"metadata": map[string]any{"labels": map[string]string{key: "false"}}}), false), "may change only the label")
		denied(t, "the spec on its own node", patchPod(ctx, agentCS, victimA, mergePatch(t, map[string]any{"spec": map[string]any{"activeDeadlineSeconds": 1}}), false), "may change only the label")
		denied(t, "a token bound to no pod", patchPod(ctx, unboundAgentCS, victimA, labelPatch(t, key, victimA.UID), false), "its token names no node")
		allowed(t, "repair's label on its own node", patchPod(ctx, agentCS, victimA, labelPatch(t, key, victimA.UID), false))
		p, err := e.admin.CoreV1().Pods(victimNS).Get(ctx, victimA.Name, metav1.GetOptions{})
		if err != nil || p.Labels[key] != repair.LabelValue || p.Labels["app"] != "victim" {
			t.Errorf("victim-a labels %v (%v)", p.Labels, err)
		}
		allowed(t, "the same label again", patchPod(ctx, agentCS, victimA, labelPatch(t, key, victimA.UID), false))

		// The redirected marker (pkg/agent marker.go MarkPatch, byte for byte).
		denied(t, "the marker on a pod of another node", patchPod(ctx, agentCS, victimB, agent.MarkPatch(victimB.UID), false),
			"may change or delete only pods of its own node", "is on node "+nodeB)
		denied(t, "the marker with another value", patchPod(ctx, agentCS, victimA, mergePatch(t, map[string]any{"metadata": map[string]any{"labels": map[string]string{agent.RedirectedLabel: "false"}}}), false),
			"may change only the label "+key+" and "+agent.RedirectedLabel)
		denied(t, "the marker and another label", patchPod(ctx, agentCS, victimA, mergePatch(t, map[string]any{"metadata": map[string]any{"labels": map[string]string{agent.RedirectedLabel: agent.RedirectedValue, "app": "owned"}}}), false),
			"may change only the label")
		denied(t, "the marker and an annotation", patchPod(ctx, agentCS, victimA, mergePatch(t, map[string]any{"metadata": map[string]any{"labels": map[string]string{agent.RedirectedLabel: agent.RedirectedValue}, "annotations": map[string]string{"x": "y"}}}), false),
			"may change only the label")
		allowed(t, "the marker on its own node", patchPod(ctx, agentCS, victimA, agent.MarkPatch(victimA.UID), false))
		p, err = e.admin.CoreV1().Pods(victimNS).Get(ctx, victimA.Name, metav1.GetOptions{})
		if err != nil || p.Labels[agent.RedirectedLabel] != agent.RedirectedValue || p.Labels[key] != repair.LabelValue || p.Labels["app"] != "victim" {
			t.Errorf("victim-a labels %v (%v)", p.Labels, err)
		}
		allowed(t, "the marker again", patchPod(ctx, agentCS, victimA, agent.MarkPatch(victimA.UID), false))
		denied(t, "another label still, with the marker set", patchPod(ctx, agentCS, victimA, otherLabel, false), "may change only the label")
		allowed(t, "an administrator is not fenced", patchPod(ctx, e.admin, victimB, otherLabel, true))
	})

	// Evict: the Eviction API (dry runs here), granted only by name. An Eviction names
	// no node, so no policy holds it to the agent's node: once granted, the agent's token
	// evicts a pod on another node too (NOTES and docs/security.md say so). pods delete
	// is never granted.
	t.Run("agent evict", func(t *testing.T) {
		evict := func(cs kubernetes.Interface, p *corev1.Pod) error {
			return cs.PolicyV1().Evictions(p.Namespace).Evict(ctx, &policyv1.Eviction{ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: p.Namespace},
				DeleteOptions: &metav1.DeleteOptions{DryRun: []string{metav1.DryRunAll}}})
		}
		del := func(cs kubernetes.Interface, p *corev1.Pod) error {
			uid := p.UID
			return cs.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &uid}, DryRun: []string{metav1.DryRunAll}})
		}
		e.applyChart([]string{"repair.action=evict"}, rbac...)
		forbidden(t, "evict without rbac.unfencedPodWrites evict", evict(agentCS, victimA))
		forbidden(t, "delete with repair action evict", del(agentCS, victimA))
		e.applyChart([]string{"repair.action=evict", "rbac.unfencedPodWrites={evict}"}, append(rbac, "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")...)
		if err := poll(ctx, 30*time.Second, func() error { return evict(agentCS, victimA) }); err != nil {
			t.Fatalf("evict a pod on its own node once granted: %v", err)
		}
		allowed(t, "evict a pod on another node once granted (no policy can fence an Eviction)", evict(agentCS, victimB))
		forbidden(t, "delete a pod on its own node (never granted)", del(agentCS, victimA))
		allowed(t, "the marker with repair action evict", patchPod(ctx, agentCS, victimA, agent.MarkPatch(victimA.UID), true))
	})

	t.Run("taint controller", func(t *testing.T) {
		get := func() *corev1.Node {
			n, err := e.admin.CoreV1().Nodes().Get(ctx, nodeA, metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
		denied(t, "label a node", patchNode(ctx, taintCS, nodeA, nodeLabel), "changes more than taints")
		n := get()
		evil := append(append([]corev1.Taint{}, n.Spec.Taints...), corev1.Taint{Key: "evil.example/x", Effect: corev1.TaintEffectNoSchedule})
		denied(t, "add another taint", patchNode(ctx, taintCS, nodeA, taintPatchOf(t, n, evil)), "changes other taints")
		evict := append(append([]corev1.Taint{}, n.Spec.Taints...), corev1.Taint{Key: taint.TaintKey, Effect: corev1.TaintEffectNoExecute})
		denied(t, "its key as NoExecute (evicts every pod)", patchNode(ctx, taintCS, nodeA, taintPatchOf(t, n, evict)), "changes other taints")
		valued := append(append([]corev1.Taint{}, n.Spec.Taints...), corev1.Taint{Key: taint.TaintKey, Value: "x", Effect: taint.TaintEffect})
		denied(t, "its taint with a value", patchNode(ctx, taintCS, nodeA, taintPatchOf(t, n, valued)), "changes other taints")
		if len(n.Spec.Taints) > 0 {
			denied(t, "remove another taint", patchNode(ctx, taintCS, nodeA, taintPatchOf(t, n, nil)), "changes other taints")
		}
		with, _ := taint.WithTaint(n.Spec.Taints, true)
		allowed(t, "add its taint (the controller's patch)", patchNode(ctx, taintCS, nodeA, taintPatchOf(t, n, with)))
		n = get()
		if !taint.HasTaint(n) {
			t.Fatalf("node taints %v", n.Spec.Taints)
		}
		ann := func(v any) []byte {
			return mergePatch(t, map[string]any{"metadata": map[string]any{"annotations": map[string]any{taint.MarkAnnotation: v}}})
		}
		denied(t, "its mark with a value that is no time", patchNode(ctx, taintCS, nodeA, ann("x")), "may only add the annotation "+taint.MarkAnnotation)
		denied(t, "another annotation", patchNode(ctx, taintCS, nodeA, mergePatch(t, map[string]any{"metadata": map[string]any{"annotations": map[string]string{"evil.example/x": "y"}}})),
			"changes other annotations")
		mark := taint.MarkValue(time.Now())
		body, changed, err := taint.NodePatch(n, taint.Remove, mark)
		if err != nil || !changed {
			t.Fatalf("NodePatch: %v, changed %v", err, changed)
		}
		allowed(t, "remove its taint and mark the node (the controller's patch)", patchNode(ctx, taintCS, nodeA, body))
		n = get()
		if taint.HasTaint(n) || n.Annotations[taint.MarkAnnotation] != mark {
			t.Errorf("node taints %v, annotations %v", n.Spec.Taints, n.Annotations)
		}
		denied(t, "change its mark", patchNode(ctx, taintCS, nodeA, ann("2000-01-01T00:00:00Z")), "changes other annotations")
		denied(t, "remove its mark", patchNode(ctx, taintCS, nodeA, ann(nil)), "changes other annotations")
		with, _ = taint.WithTaint(n.Spec.Taints, true)
		allowed(t, "add its taint to a marked node", patchNode(ctx, taintCS, nodeA, taintPatchOf(t, n, with)))
		n = get()
		without, _ := taint.WithTaint(n.Spec.Taints, false)
		allowed(t, "remove its taint (the controller's patch)", patchNode(ctx, taintCS, nodeA, taintPatchOf(t, n, without)))
		if taint.HasTaint(get()) {
			t.Error("taint still there")
		}
		nb, err := e.admin.CoreV1().Nodes().Get(ctx, nodeB, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		body, changed, err = taint.NodePatch(nb, taint.None, mark)
		if err != nil || !changed {
			t.Fatalf("NodePatch: %v, changed %v", err, changed)
		}
		allowed(t, "mark a node without a taint change (the controller's patch)", patchNode(ctx, taintCS, nodeB, body))
		forbidden(t, "delete a node", taintCS.CoreV1().Nodes().Delete(ctx, nodeB, metav1.DeleteOptions{}))
	})
}
