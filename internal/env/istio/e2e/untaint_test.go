package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/meshcni/meshcni/internal/env/demo"
	"github.com/meshcni/meshcni/internal/env/istio"
	"github.com/meshcni/meshcni/internal/env/testbed"
)

// notReadyTaint is the taint both controllers manage: meshcni's taint controller and
// istiod's untaint controller (PILOT_NODE_UNTAINT_CONTROLLERS_TAINT_NAME's default).
var notReadyTaint = corev1.Taint{Key: "cni.istio.io/not-ready", Effect: corev1.TaintEffectNoSchedule}

// TestIstiodUntaintsMeshcniNode: istiod's own untaint controller (pilot.taint.enabled,
// its CNI namespace meshcni's) removes the not-ready taint from the node once meshcni's
// agent pod, labelled k8s-app=istio-cni-node through the chart's podLabels, is Ready —
// and not while no agent pod carries the label. meshcni's taint controller is off meanwhile
// (the chart refuses both; docs/taint.md).
func TestIstiodUntaintsMeshcniNode(t *testing.T) {
	tb := up(t)
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	helm, err := demo.HelmPath(ctx, upRoot)
	if err != nil {
		t.Fatal(err)
	}
	meshcni := func(ctx context.Context, sets ...string) {
		t.Helper()
		args := append([]string{"upgrade", demo.Release, upRoot + "/" + demo.ChartDir, "--namespace", demo.ReleaseNamespace, "--reuse-values"}, sets...)
		cmd := exec.CommandContext(ctx, helm, args...)
		cmd.Env = append(os.Environ(), "KUBECONFIG="+testbed.KubeconfigPath())
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("helm %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		wctx, wcancel := context.WithTimeout(ctx, 2*time.Minute)
		defer wcancel()
		if _, err := tb.WaitDaemonSet(wctx, demo.ReleaseNamespace, "meshcni-agent"); err != nil {
			t.Fatal(err)
		}
	}

	// istiod with its untaint controller watching meshcni's namespace; restored after.
	taintValues := map[string]any{"pilot": map[string]any{"taint": map[string]any{"enabled": true, "namespace": demo.ReleaseNamespace}}}
	// Restored after: istiod and meshcni as istio.Up installs them (helm upgrade with
	// their full values: --reuse-values cannot drop a label again).
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		o := sharedOptions()
		o.Reinstall = true
		if _, err := istio.Up(ctx, tb, o); err != nil {
			t.Errorf("restore istiod and meshcni: %v", err)
		}
	})
	t.Cleanup(func() { setTaint(t, tb, false) })
	if _, err := istio.Up(ctx, tb, withTaint(sharedOptions(), taintValues)); err != nil {
		t.Fatalf("istiod with pilot.taint.enabled: %v", err)
	}
	// meshcni without its own taint controller, no label yet.
	meshcni(ctx, "--set", "taintController.enabled=false")

	setTaint(t, tb, true)
	// No agent pod carries the label: istiod leaves the taint (watched for 10 s).
	for end := time.Now().Add(10 * time.Second); time.Now().Before(end); time.Sleep(500 * time.Millisecond) {
		if !hasTaint(t, tb) {
			t.Fatal("the taint was removed while no pod carried k8s-app=istio-cni-node: something else than istiod's untaint controller acts")
		}
	}

	began := time.Now()
	meshcni(ctx, "--set", "podLabels.k8s-app=istio-cni-node") // a rolling update: a new, labelled agent pod
	var gone time.Time
	for gone.IsZero() {
		if !hasTaint(t, tb) {
			gone = time.Now()
			break
		}
		select {
		case <-ctx.Done():
			t.Fatalf("istiod did not remove the taint: %v", ctx.Err())
		case <-time.After(200 * time.Millisecond):
		}
	}
	pods, err := tb.Client.CoreV1().Pods(demo.ReleaseNamespace).List(ctx, metav1.ListOptions{LabelSelector: "k8s-app=istio-cni-node"})
	if err != nil || len(pods.Items) != 1 {
		t.Fatalf("labelled agent pods: %v, %v", pods, err)
	}
	p := pods.Items[0]
	var ready *corev1.PodCondition
	for i, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			ready = &p.Status.Conditions[i]
		}
	}
	if ready == nil || ready.Status != corev1.ConditionTrue || p.Spec.NodeName != testbed.NodeName {
		t.Fatalf("agent pod %s: Ready %+v on %s", p.Name, ready, p.Spec.NodeName)
	}
	// The API server keeps seconds: the taint went after the pod turned Ready (1 s slack).
	if ready.LastTransitionTime.Add(-time.Second).After(gone) {
		t.Errorf("taint removed at %s, before agent pod %s was Ready (%s)", gone.Format(time.RFC3339Nano), p.Name, ready.LastTransitionTime)
	}
	t.Logf("label set → taint removed by istiod in %s (agent pod %s Ready at %s)", gone.Sub(began).Round(time.Millisecond), p.Name, ready.LastTransitionTime.Format(time.RFC3339))
}

func hasTaint(t *testing.T, tb *testbed.Testbed) bool {
	t.Helper()
	n, err := tb.Client.CoreV1().Nodes().Get(context.Background(), testbed.NodeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, tn := range n.Spec.Taints {
		if tn.MatchTaint(&notReadyTaint) {
			return true
		}
	}
	return false
}

// setTaint adds or removes the not-ready taint on the test bed's node.
func setTaint(t *testing.T, tb *testbed.Testbed, on bool) {
	t.Helper()
	ctx := context.Background()
	n, err := tb.Client.CoreV1().Nodes().Get(ctx, testbed.NodeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var taints []corev1.Taint
	for _, tn := range n.Spec.Taints {
		if !tn.MatchTaint(&notReadyTaint) {
			taints = append(taints, tn)
		}
	}
	if on {
		taints = append(taints, notReadyTaint)
	}
	patch, err := json.Marshal(map[string]any{"spec": map[string]any{"taints": taints}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tb.Client.CoreV1().Nodes().Patch(ctx, testbed.NodeName, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatal(fmt.Errorf("taint %v on node: %w", on, err))
	}
}
