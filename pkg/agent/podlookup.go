package agent

import (
	"encoding/json"
	"fmt"

	corev1 "k8s.io/api/core/v1"

	"github.com/meshcni/meshcni/pkg/agentsock"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/capture/k8spod"
)

// PodSource is the agent's cache of its node's pods (*nodepods.Cache).
type PodSource interface {
	HasSynced() bool
	Get(namespace, name string) (*corev1.Pod, bool)
}

// AnswerPod answers the plugin's RequestPod from the cache: found only when the cache
// is synced, holds the pod, and the pod has the request's UID (kubelet always passes
// K8S_POD_UID; without one the cache could answer with an earlier pod of the same
// name, e.g. a StatefulSet's, so that is a miss too).
// Any other case is a miss with its reason, and the plugin asks the API server; the
// agent never answers for the API server, so its errors stay the plugin's.
func AnswerPod(pods PodSource, req agentsock.PodRequest) (agentsock.PodResponse, error) {
	switch {
	case pods == nil:
		return agentsock.PodResponse{Reason: "the agent has no pod cache (no API access or no --node-name)"}, nil
	case req.Namespace == "" || req.Name == "":
		return agentsock.PodResponse{}, fmt.Errorf("pod request without namespace or name")
	case req.UID == "":
		return agentsock.PodResponse{Reason: "no K8S_POD_UID: the cache may hold an earlier pod of that name"}, nil
	case !pods.HasSynced():
		return agentsock.PodResponse{Reason: "the agent's pod cache is not synced yet"}, nil
	}
	pod, ok := pods.Get(req.Namespace, req.Name)
	if !ok {
		return agentsock.PodResponse{Reason: "pod not in the agent's cache of this node's pods"}, nil
	}
	p := k8spod.From(pod)
	if !capture.IsRuntimePod(p, req.UID) {
		return agentsock.PodResponse{Reason: fmt.Sprintf("the cached pod has UID %s, not %s", pod.UID, req.UID)}, nil
	}
	b, err := json.Marshal(p)
	if err != nil {
		return agentsock.PodResponse{}, fmt.Errorf("encode pod %s/%s: %w", req.Namespace, req.Name, err)
	}
	return agentsock.PodResponse{Found: true, Pod: b}, nil
}
