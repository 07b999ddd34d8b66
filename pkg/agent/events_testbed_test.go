package agent_test

// Events against a real API server: two writers fight over the primary conflist and
// the agent records a ConfigConflict Warning on its own Pod.

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/testkit/agenttest"
	"github.com/meshcni/meshcni/pkg/fileutil"
)

const (
	eventsNS  = "agent-events"
	eventsPod = "meshcni-agent-events"
)

// TestConflictEventOnAgentPod runs the agent binary with --pod-name/--pod-namespace
// against a temporary CNI directory whose primary list another writer keeps
// rewriting without meshcni's entry. The agent must back off and report it: a
// Warning Event with reason ConfigConflict on its Pod, naming the fought-over file
// and the directory's other configuration, plus the conflicts metric.
func TestConflictEventOnAgentPod(t *testing.T) {
	tb := testbed.API(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := tb.CreateNamespace(ctx, eventsNS); err != nil && !apierrors.IsAlreadyExists(err) && !strings.Contains(err.Error(), "already exists") {
		t.Fatal(err)
	}
	// The agent's Pod, the Events' target. A node selector no node has keeps it
	// Pending on a full test bed (nothing runs it); API-only, nothing would anyway.
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: eventsPod, Namespace: eventsNS},
		Spec: corev1.PodSpec{
			NodeSelector: map[string]string{"meshcni.test/none": "none"},
			Containers:   []corev1.Container{{Name: "agent", Image: testbed.EchoImage, ImagePullPolicy: corev1.PullNever}},
		},
	}
	if err := tb.Client.CoreV1().Pods(eventsNS).Delete(ctx, eventsPod, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "old pod gone", func() error {
		_, err := tb.Client.CoreV1().Pods(eventsNS).Get(ctx, eventsPod, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return nil
		}
		return fmt.Errorf("still there: %v", err)
	})
	if _, err := tb.CreatePod(ctx, pod); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = tb.Client.CoreV1().Pods(eventsNS).Delete(context.Background(), eventsPod, metav1.DeleteOptions{})
	})

	dir := t.TempDir()
	conf, bin := filepath.Join(dir, "net.d"), filepath.Join(dir, "bin")
	for _, d := range []string{conf, bin} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	const primaryName, otherName = "10-fighter.conflist", "99-other.conflist"
	primary := filepath.Join(conf, primaryName)
	fighterConf := []byte(`{"cniVersion":"1.0.0","name":"fighter","plugins":[{"type":"bridge","bridge":"cni0"}]}` + "\n")
	for name, data := range map[string][]byte{
		primaryName: fighterConf,
		otherName:   []byte(`{"cniVersion":"1.0.0","name":"other","plugins":[{"type":"ptp"}]}` + "\n"),
	} {
		if err := os.WriteFile(filepath.Join(conf, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}

	a := agenttest.Start(t, agenttest.Options{
		ConfDir: conf, BinDir: bin, PodName: eventsPod, PodNamespace: eventsNS,
		Args: []string{"--conflict-threshold", "3", "--conflict-window", "10s", "--backoff-max", "1s"},
	})

	// The other writer: rewrites its file without our entry whenever ours is in it.
	fightCtx, stopFight := context.WithCancel(ctx)
	var wg sync.WaitGroup
	var rewrites int
	wg.Add(1)
	go func() {
		defer wg.Done()
		for fightCtx.Err() == nil {
			if b, err := os.ReadFile(primary); err == nil && strings.Contains(string(b), `"meshcni"`) {
				if fileutil.WriteFileAtomic(primary, fighterConf, 0o644) == nil {
					rewrites++
				}
			}
			time.Sleep(2 * time.Millisecond)
		}
	}()
	defer func() { stopFight(); wg.Wait() }()

	sel := fields.Set{"involvedObject.name": eventsPod, "involvedObject.kind": "Pod"}.AsSelector().String()
	var ev corev1.Event
	began := time.Now()
	waitFor(t, 60*time.Second, "ConfigConflict Event on the agent's Pod", func() error {
		l, err := tb.Client.CoreV1().Events(eventsNS).List(ctx, metav1.ListOptions{FieldSelector: sel})
		if err != nil {
			return err
		}
		for _, e := range l.Items {
			if e.Reason == "ConfigConflict" {
				ev = e
				return nil
			}
		}
		return fmt.Errorf("%d events, none ConfigConflict", len(l.Items))
	})
	stopFight()
	wg.Wait()
	t.Logf("Event after %v and %d rewrites by the other writer: %s %s: %s (source %s/%s, count %d)",
		time.Since(began).Round(time.Millisecond), rewrites, ev.Type, ev.Reason, ev.Message, ev.Source.Component, ev.Source.Host, ev.Count)
	if ev.Type != corev1.EventTypeWarning {
		t.Errorf("event type %q, want Warning", ev.Type)
	}
	if ev.InvolvedObject.Namespace != eventsNS || ev.InvolvedObject.Name != eventsPod {
		t.Errorf("event about %+v", ev.InvolvedObject)
	}
	for _, want := range []string{primary, otherName} {
		if !strings.Contains(ev.Message, want) {
			t.Errorf("event message does not name %s: %q", want, ev.Message)
		}
	}
	if ev.Source.Component != "meshcni-agent" || ev.Source.Host != testbed.NodeName {
		t.Errorf("event source %+v", ev.Source)
	}
	if v := metricAtLeast(t, a, "meshcni_agent_conflicts_total", map[string]string{"file": primaryName}, 1); v < 1 {
		t.Fatalf("conflicts metric %v", v)
	}
	if !strings.Contains(a.Log(), "another writer keeps removing") {
		t.Errorf("no conflict warning in the agent's log")
	}
	// The fight over, the agent puts its entry back once the backoff ends.
	waitFor(t, 10*time.Second, "entry back after the fight", func() error {
		if b, _ := os.ReadFile(primary); !strings.Contains(string(b), `"meshcni"`) {
			return fmt.Errorf("no entry:\n%s", b)
		}
		return nil
	})
	if err := a.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
}
