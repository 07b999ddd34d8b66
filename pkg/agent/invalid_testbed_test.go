package agent_test

// A half-written conflist against a real API server: the real agent binary leaves the
// file alone, records a ConfigInvalid Warning on its own Pod, sets the gauge, and puts
// its entry back once the file is whole again.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/testkit/agenttest"
)

const invalidPod = "meshcni-agent-invalid"

func TestInvalidConfigEventOnAgentPod(t *testing.T) {
	tb := testbed.API(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := tb.CreateNamespace(ctx, eventsNS); err != nil && !apierrors.IsAlreadyExists(err) && !strings.Contains(err.Error(), "already exists") {
		t.Fatal(err)
	}
	// The agent's Pod, the Events' target, kept Pending by a node selector no node has.
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: invalidPod, Namespace: eventsNS},
		Spec: corev1.PodSpec{
			NodeSelector: map[string]string{"meshcni.test/none": "none"},
			Containers:   []corev1.Container{{Name: "agent", Image: testbed.EchoImage, ImagePullPolicy: corev1.PullNever}},
		},
	}
	if err := tb.Client.CoreV1().Pods(eventsNS).Delete(ctx, invalidPod, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "old pod gone", func() error {
		_, err := tb.Client.CoreV1().Pods(eventsNS).Get(ctx, invalidPod, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return nil
		}
		return fmt.Errorf("still there: %v", err)
	})
	if _, err := tb.CreatePod(ctx, pod); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = tb.Client.CoreV1().Pods(eventsNS).Delete(context.Background(), invalidPod, metav1.DeleteOptions{})
	})

	dir := t.TempDir()
	conf, bin := filepath.Join(dir, "net.d"), filepath.Join(dir, "bin")
	for _, d := range []string{conf, bin} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	const primaryName = "10-calico.conflist"
	primary := filepath.Join(conf, primaryName)
	calicoConf := []byte(`{"cniVersion":"1.0.0","name":"k8s-pod-network","plugins":[{"type":"calico"},{"type":"portmap","capabilities":{"portMappings":true}}]}` + "\n")
	if err := os.WriteFile(primary, calicoConf, 0o644); err != nil {
		t.Fatal(err)
	}
	a := agenttest.Start(t, agenttest.Options{ConfDir: conf, BinDir: bin, PodName: invalidPod, PodNamespace: eventsNS})

	// GET /version of the real binary: exactly the three keys.
	code, body, err := agenttest.Get(strings.TrimSuffix(a.HealthURL, "/healthz") + "/version")
	if err != nil || code != 200 {
		t.Fatalf("/version = %d %s %v", code, body, err)
	}
	var version map[string]string
	if err := json.Unmarshal([]byte(body), &version); err != nil || len(version) != 3 || version["version"] == "" || version["goVersion"] == "" || version["platform"] == "" {
		t.Errorf("/version = %s (%v), want version, goVersion and platform", body, err)
	}

	// istio-cni's uninstaller (say) rewrites the file in place and stops half-way.
	whole, err := os.ReadFile(primary)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(whole, []byte(`"meshcni"`)) {
		t.Fatalf("no entry after start:\n%s", whole)
	}
	half := whole[:len(whole)/2]
	began := time.Now()
	if err := os.WriteFile(primary, half, 0o644); err != nil {
		t.Fatal(err)
	}

	sel := fields.Set{"involvedObject.name": invalidPod, "involvedObject.kind": "Pod"}.AsSelector().String()
	var ev corev1.Event
	waitFor(t, 60*time.Second, "ConfigInvalid Event on the agent's Pod", func() error {
		l, err := tb.Client.CoreV1().Events(eventsNS).List(ctx, metav1.ListOptions{FieldSelector: sel})
		if err != nil {
			return err
		}
		for _, e := range l.Items {
			if e.Reason == "ConfigInvalid" {
				ev = e
				return nil
			}
		}
		return fmt.Errorf("%d events, none ConfigInvalid", len(l.Items))
	})
	t.Logf("Event after %v: %s %s: %s (source %s/%s, count %d)", time.Since(began).Round(time.Millisecond),
		ev.Type, ev.Reason, ev.Message, ev.Source.Component, ev.Source.Host, ev.Count)
	if ev.Type != corev1.EventTypeWarning || !strings.Contains(ev.Message, primary) {
		t.Errorf("event %s %q, want a Warning naming %s", ev.Type, ev.Message, primary)
	}
	if ev.Source.Component != "meshcni-agent" || ev.Source.Host != testbed.NodeName {
		t.Errorf("event source %+v", ev.Source)
	}
	metricAtLeast(t, a, "meshcni_agent_cni_config_invalid", map[string]string{"file": primaryName}, 1)
	fams := a.Metrics(t)
	if v := value(t, fams, "meshcni_agent_cni_config_invalid_episodes_total", map[string]string{"file": primaryName}); v != 1 {
		t.Errorf("episodes = %v, want 1", v)
	}
	if got, _ := os.ReadFile(primary); !bytes.Equal(got, half) {
		t.Fatalf("the agent wrote the half-written file:\n%s", got)
	}
	// One warning of the agent's own (client-go's Event line may repeat the message).
	if n := strings.Count(a.Log(), `"msg":"CNI configuration `+primary+` is invalid, left alone`); n != 1 {
		t.Errorf("%d warnings about the invalid file, want 1", n)
	}

	// Whole again, without meshcni's entry: the agent puts it back.
	if err := os.WriteFile(primary, calicoConf, 0o644); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "entry back, gauge cleared", func() error {
		if b, _ := os.ReadFile(primary); !bytes.Contains(b, []byte(`"meshcni"`)) {
			return fmt.Errorf("no entry:\n%s", b)
		}
		fams, err := a.Scrape()
		if err != nil {
			return err
		}
		if v, ok := agenttest.Value(fams, "meshcni_agent_cni_config_invalid", map[string]string{"file": primaryName}); ok {
			return fmt.Errorf("gauge still %v", v)
		}
		return nil
	})
	if err := a.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
}
