package plugin

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/meshcni/meshcni/pkg/agentsock"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/cniconf"
)

// fetchPod GETs the pod within api_timeout and checks its UID. Every failure is a CNI
// error saying what is wrong and what to do: meshcni fails closed.
func (p *Plugin) fetchPod(ctx context.Context, inv *invocation) (*capture.Pod, error) {
	if pod := inv.podFromAgent(ctx); pod != nil {
		return pod, nil
	}
	if !cniconf.IsNamespaceName(inv.namespace) || !isPodName(inv.name) {
		return nil, types.NewError(types.ErrInvalidEnvironmentVariables, fmt.Sprintf(
			"meshcni: CNI_ARGS names pod %q in namespace %q, which Kubernetes cannot hold; %s", inv.name, inv.namespace, failsClosed), "")
	}
	getter, err := p.NewPodGetter(inv.cfg.Kubeconfig)
	if err != nil {
		return nil, types.NewError(types.ErrInternal, fmt.Sprintf(
			"meshcni cannot ask the Kubernetes API for pod %s/%s: %v; %s; check that meshcni-agent is running on this node (it answers pod lookups itself)",
			inv.namespace, inv.name, err, failsClosed), "")
	}
	ctx, cancel := context.WithTimeout(ctx, inv.cfg.APITimeout)
	defer cancel()
	t0 := time.Now()
	pod, err := getter.GetPod(ctx, inv.namespace, inv.name)
	if err != nil {
		return nil, apiFailure(inv, getter.Server(), err, time.Since(t0))
	}
	inv.log.Debug("pod fetched", "source", "api", "duration", time.Since(t0))
	if pod.Namespace != inv.namespace || pod.Name != inv.name {
		return nil, types.NewError(types.ErrInternal, fmt.Sprintf(
			"the Kubernetes API at %s answered the GET of pod %s/%s with pod %s/%s; %s", getter.Server(), inv.namespace, inv.name, pod.Namespace, pod.Name, failsClosed), "")
	}
	if inv.uid != "" && !capture.IsRuntimePod(pod, inv.uid) {
		return nil, types.NewError(types.ErrInternal, fmt.Sprintf(
			"pod %s/%s in the API has UID %s but the runtime is creating UID %s (the pod was deleted and recreated); %s; the runtime will retry with the current pod",
			inv.namespace, inv.name, pod.UID, inv.uid, failsClosed), "")
	}
	return pod, nil
}

// AgentLookupTimeout bounds the pod lookup through the agent's socket; past it the
// plugin asks the API server. The agent answers from memory, far inside this bound.
const AgentLookupTimeout = 50 * time.Millisecond

// podFromAgent asks the agent's cache of the node's pods for the pod. It returns nil
// on any miss (no agent, an agent without a cache or without the pod, another UID,
// a timeout, a bad answer): the caller then GETs the pod from the API server, so the
// agent can make ADD faster but never decides a failure.
func (inv *invocation) podFromAgent(ctx context.Context) *capture.Pod {
	if inv.sock == nil {
		return nil
	}
	t0 := time.Now()
	ctx, cancel := context.WithTimeout(ctx, AgentLookupTimeout)
	defer cancel()
	resp, err := inv.sock.GetPod(ctx, agentsock.PodRequest{Namespace: inv.namespace, Name: inv.name, UID: inv.uid})
	miss := func(reason string, args ...any) *capture.Pod {
		inv.log.Debug("pod not answered by the agent, asking the API server", append([]any{"reason", reason, "duration", time.Since(t0)}, args...)...)
		return nil
	}
	switch {
	case err != nil:
		return miss("lookup failed", "err", err)
	case !resp.Found:
		return miss(resp.Reason)
	}
	var pod capture.Pod
	if err := json.Unmarshal(resp.Pod, &pod); err != nil {
		return miss("undecodable pod", "err", err)
	}
	if pod.Namespace != inv.namespace || pod.Name != inv.name {
		return miss(fmt.Sprintf("the agent answered with pod %s/%s", pod.Namespace, pod.Name))
	}
	if inv.uid != "" && !capture.IsRuntimePod(&pod, inv.uid) {
		return miss(fmt.Sprintf("the agent's pod has UID %s, not %s", pod.UID, inv.uid))
	}
	inv.log.Debug("pod fetched", "source", "agent", "duration", time.Since(t0))
	return &pod
}

// isPodName reports whether s can be a pod's name (an RFC 1123 subdomain: lower-case
// alphanumerics, '-' and '.', alphanumeric at both ends, at most 253 bytes).
func isPodName(s string) bool {
	if len(s) == 0 || len(s) > 253 {
		return false
	}
	for _, label := range strings.Split(s, ".") {
		if len(label) == 0 || label[0] == '-' || label[len(label)-1] == '-' {
			return false
		}
		for i := 0; i < len(label); i++ {
			if c := label[i]; !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-') {
				return false
			}
		}
	}
	return true
}
