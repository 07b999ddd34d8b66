package agent

import (
	"fmt"
	"log/slog"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/record"
)

// Recorder reports notable conditions as Kubernetes Events on the agent's own Pod.
type Recorder interface {
	Warning(reason, message string)
}

// podRecorder sends Events through client-go's event recorder.
type podRecorder struct {
	rec record.EventRecorder
	ref *corev1.ObjectReference
}

func (r *podRecorder) Warning(reason, message string) {
	r.rec.Event(r.ref, corev1.EventTypeWarning, reason, message)
}

// NewPodRecorder returns a Recorder for the agent's Pod when running in a cluster (the
// in-cluster configuration loads and the pod's name and namespace are known), else nil
// with the reason. stop shuts the event broadcaster down.
func NewPodRecorder(cfg *Config, log *slog.Logger) (rec Recorder, stop func(), err error) {
	if cfg.PodName == "" || cfg.PodNamespace == "" {
		return nil, func() {}, fmt.Errorf("no pod name/namespace (set --pod-name and --pod-namespace from the downward API)")
	}
	rc, err := rest.InClusterConfig()
	if err != nil {
		return nil, func() {}, fmt.Errorf("not in a cluster: %w", err)
	}
	cs, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, func() {}, fmt.Errorf("kubernetes client: %w", err)
	}
	b := record.NewBroadcaster()
	b.StartStructuredLogging(0)
	b.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: cs.CoreV1().Events(cfg.PodNamespace)})
	r := b.NewRecorder(scheme.Scheme, corev1.EventSource{Component: "meshcni-agent", Host: cfg.NodeName})
	ref := &corev1.ObjectReference{Kind: "Pod", APIVersion: "v1", Namespace: cfg.PodNamespace, Name: cfg.PodName}
	log.Info("Kubernetes Events go to the agent's pod", "pod", cfg.PodNamespace+"/"+cfg.PodName)
	return &podRecorder{rec: r, ref: ref}, b.Shutdown, nil
}
