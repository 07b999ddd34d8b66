package deploy_test

import (
	"context"
	"errors"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
)

// withoutPolicyAPI are the API server flags of a cluster that serves no
// ValidatingAdmissionPolicy, as before Kubernetes 1.30: its resources out of discovery,
// its admission plugin off.
var withoutPolicyAPI = []string{
	"--runtime-config=admissionregistration.k8s.io/v1/validatingadmissionpolicies=false,admissionregistration.k8s.io/v1/validatingadmissionpolicybindings=false",
	"--disable-admission-plugins=ValidatingAdmissionPolicy",
}

// TestInstallWithoutPolicyAPI: `helm install` with the chart's defaults (plus the test
// bed's values) on an API server that serves no ValidatingAdmissionPolicy succeeds, the
// agent goes Ready, and its ClusterRole as stored grants no pods patch, delete or
// eviction; NOTES says the marker is off. Opting in by name (rbac.unfencedPodWrites
// patch) grants patch and NOTES says it is unfenced.
func TestInstallWithoutPolicyAPI(t *testing.T) {
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
	img := builtImage(ctx, t, root)
	tb, err := testbed.Start(ctx, testbed.Options{ImageArchives: []string{img.Out}, APIServerArgs: withoutPolicyAPI})
	if errors.Is(err, testbed.ErrRunning) {
		testutil.Missing(t, "a shared test bed is running (hack/testbed up): this test starts its own API server without the policy API; stop it to run this test")
	}
	if err != nil {
		t.Fatalf("test bed: %v", err)
	}
	t.Cleanup(func() { _ = tb.Stop(context.Background()) })

	// The negative control: the API server really serves no policy API.
	res, err := tb.Client.Discovery().ServerResourcesForGroupVersion("admissionregistration.k8s.io/v1")
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range res.APIResources {
		if r.Kind == "ValidatingAdmissionPolicy" || r.Kind == "ValidatingAdmissionPolicyBinding" {
			t.Fatalf("the API server still serves %s (%s): %v", r.Kind, r.Name, withoutPolicyAPI)
		}
	}
	createNamespace(ctx, t, tb, installNamespace)

	run := func(args ...string) string {
		t.Helper()
		cmd := exec.CommandContext(ctx, helm, args...)
		cmd.Env = append(helmEnv(helmHome), "KUBECONFIG="+tb.Kubeconfig())
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("helm %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	agentVerbs := func() (pods, eviction []string) {
		t.Helper()
		cr, err := tb.Client.RbacV1().ClusterRoles().Get(ctx, "meshcni-agent", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range cr.Rules {
			if slices.Contains(r.Verbs, "delete") || slices.Contains(r.Verbs, "*") {
				t.Errorf("stored agent rule %+v grants delete", r)
			}
		}
		return podVerbs(cr), verbsOn(cr, "pods/eviction")
	}
	values := []string{"--namespace", installNamespace, "--values", "testbed-values.yaml"}

	out := run(append([]string{"install", release, chartDir}, values...)...)
	if !strings.Contains(out, "STATUS: deployed") || !strings.Contains(out, "patch: none") || !strings.Contains(out, "--mark-redirected=false") {
		t.Errorf("helm install output (NOTES):\n%s", out)
	}
	if pods, ev := agentVerbs(); !slices.Equal(pods, []string{"list", "watch"}) || len(ev) != 0 {
		t.Errorf("agent ClusterRole: pods %v, pods/eviction %v; want list, watch only", pods, ev)
	}
	wctx, wcancel := context.WithTimeout(ctx, 2*time.Minute)
	defer wcancel()
	if _, err := tb.WaitDaemonSet(wctx, installNamespace, "meshcni-agent"); err != nil {
		t.Fatalf("agent not Ready without pods patch: %v\n%s", err, diagnose(ctx, tb))
	}
	ds, err := tb.Client.AppsV1().DaemonSets(installNamespace).Get(ctx, "meshcni-agent", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if e := envOf(ds.Spec.Template.Spec.Containers[0]); e["MESHCNI_MARK_REDIRECTED"].Value != "false" {
		t.Errorf("agent MESHCNI_MARK_REDIRECTED %q, want false", e["MESHCNI_MARK_REDIRECTED"].Value)
	}

	out = run(append([]string{"upgrade", release, chartDir, "--set", "rbac.unfencedPodWrites={patch}"}, values...)...)
	if !strings.Contains(out, "patch: UNFENCED") || !strings.Contains(out, "may patch ANY pod in the cluster") {
		t.Errorf("helm upgrade output (NOTES) with the opt-in:\n%s", out)
	}
	if pods, ev := agentVerbs(); !slices.Equal(pods, []string{"list", "patch", "watch"}) || len(ev) != 0 {
		t.Errorf("agent ClusterRole with the opt-in: pods %v, pods/eviction %v; want list, patch, watch", pods, ev)
	}
	run("uninstall", release, "--namespace", installNamespace, "--wait")
}
