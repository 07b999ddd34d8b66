package plugin

import (
	"errors"
	"fmt"
	"time"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/meshcni/meshcni/pkg/podget"
)

// failsClosed ends every error that keeps a pod from starting for want of its
// spec: meshcni fails closed.
const failsClosed = "meshcni fails closed so the pod is not started unredirected"

// apiFailure words a failed pod GET as a CNI error: what failed, where, and what
// to check (the agent, its kubeconfig or RBAC, the API server's reachability).
func apiFailure(inv *invocation, server string, err error, took time.Duration) error {
	var ke *podget.KubeconfigError
	if errors.As(err, &ke) {
		return types.NewError(types.ErrTryAgainLater, fmt.Sprintf(
			"meshcni cannot load its kubeconfig: %v; %s; check that meshcni-agent is running on this node (it writes %s)",
			ke.Err, failsClosed, inv.cfg.Kubeconfig), "")
	}
	var he *podget.HelperError
	if errors.As(err, &he) {
		return types.NewError(types.ErrInternal, fmt.Sprintf(
			"meshcni cannot ask the Kubernetes API for pod %s/%s: %v; %s; check that meshcni-agent is running on this node (it installs %s next to the plugin, and answers pod lookups itself)",
			inv.namespace, inv.name, he, failsClosed, podget.HelperName), "")
	}
	var ae *podget.APIError
	if !errors.As(err, &ae) {
		return types.NewError(types.ErrInternal, fmt.Sprintf("meshcni cannot get pod %s/%s: %v; %s", inv.namespace, inv.name, err, failsClosed), "")
	}
	switch {
	case ae.Status == 0:
		return types.NewError(types.ErrTryAgainLater, fmt.Sprintf(
			"cannot reach the Kubernetes API at %s to get pod %s/%s (gave up after %s): %v; %s; check that meshcni-agent is running on this node and that the API server is reachable from it",
			server, inv.namespace, inv.name, took.Round(time.Millisecond), ae.Err, failsClosed), "")
	case ae.Status == 401 || ae.Status == 403:
		return types.NewError(types.ErrInternal, fmt.Sprintf(
			"the Kubernetes API at %s refused to let meshcni get pod %s/%s (%d %s: %v); %s; check meshcni-agent's RBAC (it needs get on pods) and that its kubeconfig token is current",
			server, inv.namespace, inv.name, ae.Status, podget.StatusText(ae.Status), ae.Err, failsClosed), "")
	case ae.Status == 404:
		return types.NewError(types.ErrInternal, fmt.Sprintf(
			"pod %s/%s not found in the Kubernetes API at %s (gave up after %s); %s; if it is a static pod, wait for its mirror pod, otherwise it was deleted",
			inv.namespace, inv.name, server, took.Round(time.Millisecond), failsClosed), "")
	case ae.Status == 200:
		return types.NewError(types.ErrInternal, fmt.Sprintf(
			"the Kubernetes API at %s answered the GET of pod %s/%s with something that is not a pod (%v); %s; check that the kubeconfig's server is the API server",
			server, inv.namespace, inv.name, ae.Err, failsClosed), "")
	}
	return types.NewError(types.ErrTryAgainLater, fmt.Sprintf(
		"the Kubernetes API at %s failed to return pod %s/%s (%d %s: %v, gave up after %s); %s",
		server, inv.namespace, inv.name, ae.Status, podget.StatusText(ae.Status), ae.Err, took.Round(time.Millisecond), failsClosed), "")
}
