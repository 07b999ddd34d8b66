package agent

import (
	"context"
	"fmt"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// KeepMode says whether the agent leaves the plugin installed (binary, kubeconfig,
// configuration entry) when it stops (--keep-on-exit).
type KeepMode string

const (
	// KeepAuto keeps the plugin when the agent's DaemonSet still exists and is not
	// being deleted (a rolling upgrade, a restart, an eviction: another agent takes
	// over), and removes it otherwise (an uninstall).
	KeepAuto KeepMode = "auto"
	// KeepAlways always leaves the plugin in place.
	KeepAlways KeepMode = "always"
	// KeepNever always removes it.
	KeepNever KeepMode = "never"
)

// ParseKeepMode reads auto, always or never; true and false (the flag's former
// boolean values) mean always and never.
func ParseKeepMode(s string) (KeepMode, error) {
	switch s {
	case "auto", "always", "never":
		return KeepMode(s), nil
	case "true":
		return KeepAlways, nil
	case "false":
		return KeepNever, nil
	}
	return "", fmt.Errorf("--keep-on-exit %q: want auto, always or never", s)
}

// DecideExit is KeepAuto's decision from a GET of the agent's DaemonSet: keep when it
// exists and is not being deleted; remove when it is gone, being deleted, or the
// agent may no longer read it (401/403: its service account or its RBAC is gone, as
// `helm uninstall` removes them). Any other error is not final: the caller retries,
// then removes.
func DecideExit(ds *appsv1.DaemonSet, err error) (keep, final bool, reason string) {
	switch {
	case err == nil && ds.DeletionTimestamp == nil:
		return true, true, fmt.Sprintf("DaemonSet %s/%s exists: an upgrade, restart or eviction, the next agent takes over", ds.Namespace, ds.Name)
	case err == nil:
		return false, true, fmt.Sprintf("DaemonSet %s/%s is being deleted", ds.Namespace, ds.Name)
	case apierrors.IsNotFound(err):
		return false, true, "the agent's DaemonSet is gone: " + err.Error()
	case apierrors.IsUnauthorized(err), apierrors.IsForbidden(err):
		return false, true, "the agent may no longer read its DaemonSet (service account or RBAC removed): " + err.Error()
	}
	return false, false, "cannot read the agent's DaemonSet: " + err.Error()
}

// exitTries and exitTryTimeout bound KeepAuto's question to the API server: at most
// 3 GETs of 2 s, 1 s apart (≈ 8 s of the pod's 30 s grace period).
const (
	exitTries      = 3
	exitTryTimeout = 2 * time.Second
	exitRetryWait  = time.Second
)

// keepOnExit decides whether to leave the plugin installed, and why.
func keepOnExit(mode KeepMode, cs kubernetes.Interface, namespace, name string, wait time.Duration) (bool, string) {
	switch mode {
	case KeepAlways:
		return true, "--keep-on-exit always"
	case KeepNever:
		return false, "--keep-on-exit never"
	}
	if cs == nil {
		return false, "--keep-on-exit auto without API access"
	}
	if namespace == "" || name == "" {
		return false, "--keep-on-exit auto without --daemonset-name and --pod-namespace"
	}
	var reason string
	for i := range exitTries {
		if i > 0 {
			time.Sleep(wait)
		}
		ctx, cancel := context.WithTimeout(context.Background(), exitTryTimeout)
		ds, err := cs.AppsV1().DaemonSets(namespace).Get(ctx, name, metav1.GetOptions{})
		cancel()
		keep, final, why := DecideExit(ds, err)
		if final {
			return keep, why
		}
		reason = why
	}
	return false, fmt.Sprintf("%s (%d tries): removing", reason, exitTries)
}
