package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/meshcni/meshcni/pkg/agentsock"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/capture/k8spod"
)

// The marker's label: `kubectl get pods -L meshcni.io/redirected` shows which pods
// meshcni redirected. The chart's admission policy lets the agent set this key, with
// this value, on its own node's pods only.
const (
	RedirectedLabel = "meshcni.io/redirected"
	RedirectedValue = "true"
)

// Marker labels each pod the plugin redirected with RedirectedLabel=true. The plugin
// writes nothing to the API: the agent learns of each successful ADD from the result
// the plugin reports on the agent socket (Observe), finds the pod in its cache of the
// node's pods, and labels it when capture.Decide says it is meshed with the plugin's
// configuration (Mesh) — for such a pod ADD succeeds only once the redirect is in
// place, since the plugin fails closed. The patch names the cached pod's UID, so a
// later pod of the same name is never labelled for an earlier one's ADD.
type Marker struct {
	Client kubernetes.Interface
	Pods   PodSource
	Mesh   capture.Config
	Log    *slog.Logger
	// Wait bounds how long a pod is looked for in the cache after its ADD (10 s when
	// zero); Poll is the look's period (100 ms when zero).
	Wait, Poll time.Duration
	// Workers patch concurrently (2 when zero).
	Workers int

	queue   chan agentsock.Pod
	metrics *prometheus.CounterVec
}

// MarkerQueue is how many ADD results wait for the marker before it drops one (the
// pod stays unlabelled; the drop is logged and counted).
const MarkerQueue = 1024

// NewMarker returns a Marker with its metric meshcni_agent_redirected_marks_total
// registered in reg.
func NewMarker(cs kubernetes.Interface, pods PodSource, mesh capture.Config, log *slog.Logger, reg prometheus.Registerer) (*Marker, error) {
	m := &Marker{Client: cs, Pods: pods, Mesh: mesh, Log: log, queue: make(chan agentsock.Pod, MarkerQueue)}
	m.metrics = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "meshcni_agent_redirected_marks_total",
		Help: "Pods the agent labelled " + RedirectedLabel + "=" + RedirectedValue + " after the plugin's ADD, by result (marked, already, skipped, gone, dropped, error).",
	}, []string{"result"})
	if err := reg.Register(m.metrics); err != nil {
		return nil, fmt.Errorf("marker metrics: %w", err)
	}
	return m, nil
}

// Name implements Runnable.
func (m *Marker) Name() string { return "redirected marker" }

// Observe takes one command result from the plugin; a successful ADD of a named pod is
// queued for marking. It never blocks the socket.
func (m *Marker) Observe(r *agentsock.CommandResult) {
	if r.Command != agentsock.CommandAdd || r.Result != agentsock.ResultSuccess || r.Pod.Namespace == "" || r.Pod.Name == "" {
		return
	}
	select {
	case m.queue <- r.Pod:
	default:
		m.count("dropped")
		m.Log.Warn("redirected marker: queue full, the pod stays unlabelled", "pod_namespace", r.Pod.Namespace, "pod_name", r.Pod.Name)
	}
}

// Run marks queued pods until ctx ends.
func (m *Marker) Run(ctx context.Context) error {
	workers := m.Workers
	if workers <= 0 {
		workers = 2
	}
	done := make(chan struct{})
	for range workers {
		go func() {
			defer func() { done <- struct{}{} }()
			for {
				select {
				case <-ctx.Done():
					return
				case p := <-m.queue:
					m.mark(ctx, p)
				}
			}
		}()
	}
	for range workers {
		<-done
	}
	return nil
}

// mark labels one pod, or logs why not.
func (m *Marker) mark(ctx context.Context, p agentsock.Pod) {
	log := m.Log.With("pod_namespace", p.Namespace, "pod_name", p.Name)
	pod := m.await(ctx, p)
	if pod == nil {
		m.count("gone")
		log.Debug("redirected marker: pod not in the node's cache after its ADD")
		return
	}
	switch act, why := MarkAction(pod, m.Mesh); act {
	case MarkNone:
		m.count("skipped")
		log.Debug("redirected marker: not labelled", "reason", why)
		return
	case MarkAlready:
		m.count("already")
		return
	}
	_, err := m.Client.CoreV1().Pods(p.Namespace).Patch(ctx, p.Name, types.MergePatchType, MarkPatch(pod.UID), metav1.PatchOptions{})
	switch {
	case err == nil:
		m.count("marked")
		log.Debug("redirected marker: labelled", "label", RedirectedLabel)
	case apierrors.IsNotFound(err) || UIDMismatch(err):
		m.count("gone")
		log.Debug("redirected marker: pod gone or replaced before the label", "err", err)
	default:
		m.count("error")
		log.Warn("redirected marker: cannot label the pod", "label", RedirectedLabel, "err", err)
	}
}

// await returns the pod from the cache once it is there, nil after Wait.
func (m *Marker) await(ctx context.Context, p agentsock.Pod) *corev1.Pod {
	wait, poll := m.Wait, m.Poll
	if wait <= 0 {
		wait = 10 * time.Second
	}
	if poll <= 0 {
		poll = 100 * time.Millisecond
	}
	deadline := time.Now().Add(wait)
	for {
		if m.Pods.HasSynced() {
			if pod, ok := m.Pods.Get(p.Namespace, p.Name); ok {
				return pod
			}
		}
		if time.Now().After(deadline) {
			return nil
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(poll):
		}
	}
}

func (m *Marker) count(result string) {
	if m.metrics != nil {
		m.metrics.WithLabelValues(result).Inc()
	}
}

type MarkAct int

const (
	MarkNone MarkAct = iota
	MarkAlready
	MarkLabel
)

// MarkAction says what the marker does to a pod whose ADD succeeded: label it when
// capture.Decide (the plugin's decision) says it is meshed and it is not labelled
// yet; the reason says why not otherwise.
func MarkAction(pod *corev1.Pod, mesh capture.Config) (MarkAct, string) {
	d := capture.Decide(k8spod.From(pod), mesh)
	if !d.Captured() {
		return MarkNone, d.Reason
	}
	if pod.Labels[RedirectedLabel] == RedirectedValue {
		return MarkAlready, "already labelled"
	}
	return MarkLabel, d.Reason
}

// MarkPatch is the marker's JSON merge patch: the label, and the pod's UID, which the
// API server checks (a pod of the same name with another UID answers UIDMismatch).
func MarkPatch(uid types.UID) []byte {
	b, _ := json.Marshal(map[string]any{"metadata": map[string]any{
		"labels": map[string]string{RedirectedLabel: RedirectedValue},
		"uid":    uid,
	}})
	return b
}

// UIDMismatch reports whether err is the API server's refusal of a patch naming
// another UID than the pod's (422, metadata.uid is immutable).
func UIDMismatch(err error) bool {
	var st apierrors.APIStatus
	if !apierrors.IsInvalid(err) || !errors.As(err, &st) || st.Status().Details == nil {
		return false
	}
	for _, c := range st.Status().Details.Causes {
		if c.Field == "metadata.uid" {
			return true
		}
	}
	return false
}
