package precheck

import (
	"context"
	"fmt"
	"net/url"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"

	"github.com/meshcni/meshcni/pkg/meshcnictl/kubeget"
)

// nadPath lists Multus' NetworkAttachmentDefinitions of every namespace.
const nadPath = "apis/k8s.cni.cncf.io/v1/network-attachment-definitions"

// Collect lists, cluster-wide, what Run judges: nodes, DaemonSets, pods that have
// not ended, istiod's injector ConfigMaps (labelled istio.io/rev, named
// istio-sidecar-injector[-REVISION]) and Multus' NetworkAttachmentDefinitions
// (nil when the API server does not serve them). It only reads (list verbs).
func Collect(ctx context.Context, c *kubeget.Client) (Input, error) {
	var in Input
	var err error
	if in.Nodes, err = kubeget.List[corev1.Node](ctx, c, "api/v1/nodes", nil); err != nil {
		return in, fmt.Errorf("list nodes: %w", err)
	}
	if in.DaemonSets, err = kubeget.List[appsv1.DaemonSet](ctx, c, "apis/apps/v1/daemonsets", nil); err != nil {
		return in, fmt.Errorf("list DaemonSets: %w", err)
	}
	live := url.Values{"fieldSelector": {"status.phase!=Succeeded,status.phase!=Failed"}}
	if in.Pods, err = kubeget.List[corev1.Pod](ctx, c, "api/v1/pods", live); err != nil {
		return in, fmt.Errorf("list pods: %w", err)
	}
	cms, err := kubeget.List[corev1.ConfigMap](ctx, c, "api/v1/configmaps", url.Values{"labelSelector": {"istio.io/rev"}})
	if err != nil {
		return in, fmt.Errorf("list istiod's injector ConfigMaps: %w", err)
	}
	for _, cm := range cms {
		if IsInjectorConfigMap(cm.Name) {
			in.InjectorConfigMaps = append(in.InjectorConfigMaps, cm)
		}
	}
	in.NetworkAttachments, err = networkAttachments(ctx, c)
	return in, err
}

func networkAttachments(ctx context.Context, c *kubeget.Client) ([]NetworkAttachment, error) {
	type nad struct {
		Metadata struct {
			Namespace string            `json:"namespace"`
			Name      string            `json:"name"`
			Labels    map[string]string `json:"labels"`
		} `json:"metadata"`
		Spec struct {
			Config string `json:"config"`
		} `json:"spec"`
	}
	items, err := kubeget.List[nad](ctx, c, nadPath, nil)
	switch {
	case kubeget.IsNotFound(err):
		return nil, nil // Multus' CRD is not installed
	case err != nil:
		return nil, fmt.Errorf("list NetworkAttachmentDefinitions: %w", err)
	}
	out := make([]NetworkAttachment, 0, len(items))
	for _, n := range items {
		out = append(out, NetworkAttachment{Namespace: n.Metadata.Namespace, Name: n.Metadata.Name,
			Labels: n.Metadata.Labels, Config: strings.TrimSpace(n.Spec.Config)})
	}
	return out, nil
}
