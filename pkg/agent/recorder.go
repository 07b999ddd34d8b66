package agent

import (
	"fmt"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
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

// Kube is the agent's own access to the API server: a client and an Event recorder
// for any object (the agent's pod, the pods it repairs).
type Kube struct {
	Client kubernetes.Interface
	Events record.EventRecorder
	stop   func()
}

// Stop shuts the Event broadcaster down, flushing what it can.
func (k *Kube) Stop() { k.stop() }

// NewKube builds the agent's API client from --kubeconfig, or from the pod's in-cluster
// service account when that is empty. The error says why there is no API access.
func NewKube(cfg *Config) (*Kube, error) {
	var rc *rest.Config
	var err error
	if cfg.Kubeconfig != "" {
		rc, err = clientcmd.BuildConfigFromFlags("", cfg.Kubeconfig)
		if err != nil {
			return nil, fmt.Errorf("--kubeconfig %s: %w", cfg.Kubeconfig, err)
		}
	} else if rc, err = rest.InClusterConfig(); err != nil {
		return nil, fmt.Errorf("not in a cluster and no --kubeconfig: %w", err)
	}
	rc.UserAgent = "meshcni-agent"
	// Protobuf: less to decode (and less garbage) than JSON for the pod list and watch.
	rc.ContentType = "application/vnd.kubernetes.protobuf"
	rc.AcceptContentTypes = "application/vnd.kubernetes.protobuf,application/json"
	cs, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("kubernetes client: %w", err)
	}
	return NewKubeFor(cs, cfg.NodeName), nil
}

// NewKubeFor wraps an existing client (tests): Events are sent as meshcni-agent on node.
func NewKubeFor(cs kubernetes.Interface, node string) *Kube {
	b := record.NewBroadcaster()
	b.StartStructuredLogging(0)
	b.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: cs.CoreV1().Events("")})
	r := b.NewRecorder(scheme.Scheme, corev1.EventSource{Component: "meshcni-agent", Host: node})
	return &Kube{Client: cs, Events: r, stop: b.Shutdown}
}

// NewPodRecorder returns a Recorder for the agent's own Pod, or an error saying why
// there is none (no API access, or the pod's name and namespace are unknown).
func NewPodRecorder(cfg *Config, k *Kube) (Recorder, error) {
	if k == nil {
		return nil, fmt.Errorf("no API access")
	}
	if cfg.PodName == "" || cfg.PodNamespace == "" {
		return nil, fmt.Errorf("no pod name/namespace (set --pod-name and --pod-namespace from the downward API)")
	}
	ref := &corev1.ObjectReference{Kind: "Pod", APIVersion: "v1", Namespace: cfg.PodNamespace, Name: cfg.PodName}
	return &podRecorder{rec: k.Events, ref: ref}, nil
}
