package agent_test

// The audit in the real agent on the test bed: a meshed pod started through the
// chain, its redirect changed from the node (a foreign rule in meshcni's chain): the
// agent repairs it, raises a Warning Event on the pod through the real API server and
// counts it; then every meshcni rule removed from the pod (which has no validation
// init container): its sandbox's ADD is recorded as meshed, so the agent repairs
// it in place and never deletes it.

import (
	"context"
	"fmt"
	"net/netip"
	"os/exec"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/testkit/agenttest"
	"github.com/meshcni/meshcni/internal/testkit/traffic"
	"github.com/meshcni/meshcni/pkg/audit"
	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/capture/k8spod"
	"github.com/meshcni/meshcni/pkg/engine"
)

// podEvent waits for an Event with reason on the pod (by UID) and returns its message.
func podEvent(t *testing.T, ctx context.Context, tb *testbed.Testbed, pod *corev1.Pod, reason string, d time.Duration) string {
	t.Helper()
	var msg string
	waitFor(t, d, "Event "+reason+" on "+pod.Name, func() error {
		evs, err := tb.Client.CoreV1().Events(pod.Namespace).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.uid=" + string(pod.UID)})
		if err != nil {
			return err
		}
		for _, e := range evs.Items {
			if e.Reason == reason && e.Type == corev1.EventTypeWarning {
				msg = e.Message
				return nil
			}
		}
		return fmt.Errorf("%d events, none %s", len(evs.Items), reason)
	})
	return msg
}

func TestAuditOnTestbed(t *testing.T) {
	tb := testbed.Shared(t)
	nft, err := exec.LookPath("nft")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if err := tb.CreateNamespace(ctx, e2eNS); err != nil && !apierrors.IsAlreadyExists(err) && !strings.Contains(err.Error(), "already exists") {
		t.Fatal(err)
	}
	const period = 2 * time.Second
	a := agenttest.Start(t, agenttest.Options{Args: []string{"--resync", "200ms", "--backend", "nftables",
		"--audit-period", period.String(), "--repair-netns-dirs", testbed.NetnsDir}})
	pod, err := tb.CreatePod(ctx, meshedPod("audit-meshed"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tb.DeletePod(context.Background(), e2eNS, "audit-meshed") })
	if pod, err = tb.WaitPodRunning(ctx, e2eNS, pod.Name); err != nil {
		t.Fatal(err)
	}
	netns, err := tb.PodNetns(ctx, e2eNS, pod.Name)
	if err != nil {
		t.Fatal(err)
	}
	s, err := capture.Spec(k8spod.From(pod))
	if err != nil {
		t.Fatal(err)
	}
	capture.WithFamilies(s, []netip.Addr{netip.MustParseAddr(pod.Status.PodIP)})
	check := func() backend.Drift {
		d, err := engine.Check(ctx, engine.Options{Backend: backend.Nftables, NetnsPath: netns}, s)
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	if d := check(); !d.Empty() {
		t.Fatalf("the plugin's redirect:\n%s", d)
	}

	// 1. A foreign rule in meshcni's chain, from the node: repaired within a period
	// (+ jitter and spread), with a Warning Event and the metrics.
	if _, err := traffic.RunInNetns(netns, traffic.Root, 10*time.Second, nft, "insert", "rule", "inet", "istio-proxy-nat", "istio-output", "ip", "daddr", "10.213.0.1", "return"); err != nil {
		t.Fatal(err)
	}
	changed := time.Now()
	if d := check(); d.Empty() {
		t.Fatal("no drift after inserting a rule")
	}
	msg := podEvent(t, ctx, tb, pod, audit.EventDrift, 3*period)
	if !strings.Contains(msg, string(engine.ReasonForeignRule)) || !strings.Contains(msg, "re-applied in place") {
		t.Errorf("Event message %q: want the foreign rule named and the repair", msg)
	}
	waitFor(t, 10*time.Second, "the redirect repaired", func() error {
		if d := check(); !d.Empty() {
			return fmt.Errorf("drift:\n%s", d)
		}
		return nil
	})
	t.Logf("foreign rule repaired, Event seen %v after the change", time.Since(changed).Round(time.Millisecond))
	metricAtLeast(t, a, "meshcni_drift_detected_total", map[string]string{"reason": string(engine.ReasonForeignRule)}, 1)
	metricAtLeast(t, a, "meshcni_drift_repaired_total", map[string]string{"reason": string(engine.ReasonForeignRule)}, 1)
	if !strings.Contains(a.Log(), audit.LogDrift) {
		t.Error("no log line " + audit.LogDrift)
	}

	// 2. Every meshcni rule removed: the pod has no validation init container, but
	// its sandbox's ADD is recorded as meshed, so it did not escape: the missing
	// rules are drift, repaired in place by the default action; the pod is never
	// deleted.
	if err := engine.Clean(ctx, engine.Options{NetnsPath: netns}); err != nil {
		t.Fatal(err)
	}
	cleaned := time.Now()
	waitFor(t, 10*time.Second, "the redirect repaired after every rule was removed", func() error {
		if d := check(); !d.Empty() {
			return fmt.Errorf("drift:\n%s", d)
		}
		return nil
	})
	t.Logf("every rule removed: repaired %v after", time.Since(cleaned).Round(time.Millisecond))
	p, err := tb.Client.CoreV1().Pods(e2eNS).Get(ctx, pod.Name, metav1.GetOptions{})
	if err != nil || p.UID != pod.UID || p.DeletionTimestamp != nil {
		t.Fatalf("the pod whose ADD is recorded was deleted or replaced: %v", err)
	}
	metricAtLeast(t, a, "meshcni_drift_repaired_total", map[string]string{"reason": string(engine.ReasonMissingChain)}, 1)
	if strings.Contains(a.Log(), audit.LogEscaped) {
		t.Error("a pod whose ADD is recorded was judged escaped")
	}
	if err := a.Stop(); err != nil {
		t.Fatal(err)
	}
}
