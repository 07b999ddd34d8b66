package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/pkg/agent/nodepods"
	"github.com/meshcni/meshcni/pkg/agentsock"
	"github.com/meshcni/meshcni/pkg/capture"
)

// markPod is a pod as Istio's injector renders it in the CNI mode (istio-proxy a
// native sidecar, the status annotation), with or without istio-validation.
func markPod(ns, name, node string, validation bool) *corev1.Pod {
	always := corev1.ContainerRestartPolicyAlways
	inits := []corev1.Container{{Name: capture.ProxyContainer, Image: "meshcni.local/none:dev", Args: []string{"proxy", "sidecar"}, RestartPolicy: &always}}
	if validation {
		inits = append([]corev1.Container{{Name: "istio-validation", Image: "meshcni.local/none:dev"}}, inits...)
	}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name,
			Annotations: map[string]string{capture.AnnotationStatus: `{"containers":[],"initContainers":["istio-proxy"]}`}},
		Spec: corev1.PodSpec{NodeName: node, InitContainers: inits,
			Containers: []corev1.Container{{Name: "app", Image: "meshcni.local/none:dev"}}},
	}
}

func TestMarkAction(t *testing.T) {
	mesh := capture.Config{ExcludeNamespaces: []string{"kube-system"}}
	labelled := markPod("a", "p", "n", false)
	labelled.Labels = map[string]string{RedirectedLabel: RedirectedValue}
	falseLabel := markPod("a", "p", "n", false)
	falseLabel.Labels = map[string]string{RedirectedLabel: "false"}
	plain := markPod("a", "p", "n", false)
	plain.Spec.InitContainers = nil
	withInit := markPod("a", "p", "n", false)
	withInit.Spec.InitContainers = append(withInit.Spec.InitContainers, corev1.Container{Name: capture.InitContainer})
	optOut := markPod("a", "p", "n", false)
	optOut.Labels = map[string]string{capture.AnnotationInject: "false"}
	for _, tc := range []struct {
		name string
		pod  *corev1.Pod
		want MarkAct
	}{
		{"validation-free meshed pod", markPod("a", "p", "n", false), MarkLabel},
		{"meshed pod with istio-validation", markPod("a", "p", "n", true), MarkLabel},
		{"already labelled", labelled, MarkAlready},
		{"labelled false by someone: set to true", falseLabel, MarkLabel},
		{"no istio-proxy", plain, MarkNone},
		{"istio-init redirects by itself", withInit, MarkNone},
		{"opted out", optOut, MarkNone},
		{"excluded namespace", markPod("kube-system", "p", "n", false), MarkNone},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, why := MarkAction(tc.pod, mesh)
			if got != tc.want {
				t.Errorf("MarkAction = %d (%s), want %d", got, why, tc.want)
			}
		})
	}
}

func TestMarkPatch(t *testing.T) {
	var got map[string]any
	if err := json.Unmarshal(MarkPatch("u-1"), &got); err != nil {
		t.Fatal(err)
	}
	want := map[string]any{"metadata": map[string]any{"labels": map[string]any{"meshcni.io/redirected": "true"}, "uid": "u-1"}}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("patch %v, want %v", got, want)
	}
}

// TestMarkerObserve: only a successful ADD of a named pod is queued, and a full queue
// drops (counted) instead of blocking the socket.
func TestMarkerObserve(t *testing.T) {
	m, err := NewMarker(nil, nil, capture.Config{}, slog.New(slog.DiscardHandler), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	pod := agentsock.Pod{Namespace: "a", Name: "p"}
	for _, r := range []agentsock.CommandResult{
		{Command: agentsock.CommandAdd, Result: agentsock.ResultError, Pod: pod},
		{Command: agentsock.CommandDel, Result: agentsock.ResultSuccess, Pod: pod},
		{Command: agentsock.CommandCheck, Result: agentsock.ResultSuccess, Pod: pod},
		{Command: agentsock.CommandAdd, Result: agentsock.ResultSuccess},
		{Command: agentsock.CommandAdd, Result: agentsock.ResultSuccess, Pod: agentsock.Pod{Name: "p"}},
	} {
		m.Observe(&r)
	}
	if len(m.queue) != 0 {
		t.Fatalf("queued %d results, want none", len(m.queue))
	}
	for range MarkerQueue + 3 {
		m.Observe(&agentsock.CommandResult{Command: agentsock.CommandAdd, Result: agentsock.ResultSuccess, Pod: pod})
	}
	if len(m.queue) != MarkerQueue {
		t.Errorf("queued %d, want %d", len(m.queue), MarkerQueue)
	}
	if got := promtest.ToFloat64(m.metrics.WithLabelValues("dropped")); got != 3 {
		t.Errorf("dropped %v, want 3", got)
	}
}

// TestMarkerRealAPI: the marker with the node's pod cache on a real API server labels
// the meshed pod whose ADD succeeded, and not a plain pod, a meshed pod whose ADD
// failed, nor a pod on another node; a patch naming another UID is refused.
func TestMarkerRealAPI(t *testing.T) {
	tb := testbed.API(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const ns, node = "agent-marker", "agent-marker-node" // no such Node: the pods never run
	if err := tb.CreateNamespace(ctx, ns); err != nil && !apierrors.IsAlreadyExists(errors.Unwrap(err)) {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tb.Client.CoreV1().Namespaces().Delete(context.Background(), ns, metav1.DeleteOptions{}) })
	pods := map[string]*corev1.Pod{
		"meshed":       markPod(ns, "meshed", node, false),
		"plain":        markPod(ns, "plain", node, false),
		"add-failed":   markPod(ns, "add-failed", node, false),
		"other-node":   markPod(ns, "other-node", "agent-marker-other", false),
		"with-checker": markPod(ns, "with-checker", node, true),
	}
	pods["plain"].Spec.InitContainers = nil
	for n, p := range pods {
		out, err := tb.Client.CoreV1().Pods(ns).Create(ctx, p, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		pods[n] = out
	}
	cache, err := nodepods.New(tb.Client, node, 0)
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	m, err := NewMarker(tb.Client, cache, capture.Config{}, slog.Default(), reg)
	if err != nil {
		t.Fatal(err)
	}
	m.Wait = 2 * time.Second
	rctx, stop := context.WithCancel(ctx)
	defer stop()
	go func() { _ = cache.Run(rctx) }()
	go func() { _ = m.Run(rctx) }()
	for _, n := range []string{"meshed", "plain", "other-node", "with-checker"} {
		m.Observe(&agentsock.CommandResult{Command: agentsock.CommandAdd, Result: agentsock.ResultSuccess, Pod: agentsock.Pod{Namespace: ns, Name: n}})
	}
	m.Observe(&agentsock.CommandResult{Command: agentsock.CommandAdd, Result: agentsock.ResultError, Pod: agentsock.Pod{Namespace: ns, Name: "add-failed"}})
	// Wait until the marker has handled the four results it queued.
	for {
		total := 0.0
		for _, r := range []string{"marked", "already", "skipped", "gone", "error"} {
			total += promtest.ToFloat64(m.metrics.WithLabelValues(r))
		}
		if total >= 4 {
			break
		}
		select {
		case <-ctx.Done():
			t.Fatalf("the marker handled %v of 4 results", total)
		case <-time.After(50 * time.Millisecond):
		}
	}
	for n, want := range map[string]string{"meshed": RedirectedValue, "with-checker": RedirectedValue, "plain": "", "add-failed": "", "other-node": ""} {
		p, err := tb.Client.CoreV1().Pods(ns).Get(ctx, n, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if got := p.Labels[RedirectedLabel]; got != want {
			t.Errorf("pod %s: label %s=%q, want %q", n, RedirectedLabel, got, want)
		}
	}
	for r, want := range map[string]float64{"marked": 2, "skipped": 1, "gone": 1, "error": 0} {
		if got := promtest.ToFloat64(m.metrics.WithLabelValues(r)); got != want {
			t.Errorf("marks %s = %v, want %v", r, got, want)
		}
	}
	// The UID in the patch is a precondition: a pod of that name with another UID is
	// not labelled.
	_, err = tb.Client.CoreV1().Pods(ns).Patch(ctx, "plain", types.MergePatchType, MarkPatch(pods["meshed"].UID), metav1.PatchOptions{})
	if !UIDMismatch(err) {
		t.Errorf("patch with another pod's UID: %v, want the UID refused", err)
	}
	if p, err := tb.Client.CoreV1().Pods(ns).Get(ctx, "plain", metav1.GetOptions{}); err != nil || p.Labels[RedirectedLabel] != "" {
		t.Errorf("pod plain after the refused patch: labels %v (%v)", p.Labels, err)
	}
}
