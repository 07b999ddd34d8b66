// Package agentversion tells which meshcni version each node's agent runs: from the
// agent's GET /version (JSON, on its health and metrics port), else from its pod's
// image reference.
package agentversion

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strings"

	corev1 "k8s.io/api/core/v1"

	"github.com/meshcni/meshcni/pkg/buildinfo"
)

// Path is the agent's version endpoint on its health and metrics server.
const Path = "version"

// DefaultPort is the agent's health and metrics port when its pod names none
// (the chart's metrics.port).
const DefaultPort = 9807

// PortName is the name of the agent container's health and metrics port in the chart.
const PortName = "metrics"

// Decode parses the answer of GET /version (the agent's buildinfo.Info); a version
// is required.
func Decode(body []byte) (buildinfo.Info, error) {
	var i buildinfo.Info
	if err := json.Unmarshal(body, &i); err != nil {
		return buildinfo.Info{}, fmt.Errorf("parse /version: %w", err)
	}
	if i.Version == "" {
		return buildinfo.Info{}, errors.New("parse /version: no \"version\"")
	}
	return i, nil
}

// Sources of a Node's version.
const (
	FromAgent = "agent" // the agent's /version
	FromImage = "image" // the tag or digest of the agent pod's image
)

// Node is the agent version on one node.
type Node struct {
	Node      string `json:"node"`
	Pod       string `json:"pod"` // namespace/name
	Image     string `json:"image"`
	Version   string `json:"version"`
	GoVersion string `json:"goVersion,omitempty"`
	Platform  string `json:"platform,omitempty"`
	// Source is FromAgent or FromImage.
	Source string `json:"source"`
	// Note says why the version comes from the image.
	Note string `json:"note,omitempty"`
}

// Fetch GETs path from port of a pod (the API server's pods proxy).
type Fetch func(ctx context.Context, pod *corev1.Pod, port int, path string) ([]byte, error)

// Collect asks each agent pod for its version, falling back to its image with a note
// when the pod does not answer. The result is sorted by node.
func Collect(ctx context.Context, pods []corev1.Pod, fetch Fetch) []Node {
	out := make([]Node, 0, len(pods))
	for i := range pods {
		out = append(out, one(ctx, &pods[i], fetch))
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Node != out[j].Node {
			return out[i].Node < out[j].Node
		}
		return out[i].Pod < out[j].Pod
	})
	return out
}

func one(ctx context.Context, pod *corev1.Pod, fetch Fetch) Node {
	c, port := agentContainer(pod)
	n := Node{Node: pod.Spec.NodeName, Pod: pod.Namespace + "/" + pod.Name, Image: c.Image}
	if n.Node == "" {
		n.Node = "(unscheduled)"
	}
	var err error
	if pod.Status.Phase != corev1.PodRunning {
		err = fmt.Errorf("pod is %s", strings.ToLower(string(pod.Status.Phase)))
	} else {
		var body []byte
		if body, err = fetch(ctx, pod, port, Path); err == nil {
			var i buildinfo.Info
			if i, err = Decode(body); err == nil {
				n.Version, n.GoVersion, n.Platform, n.Source = i.Version, i.GoVersion, i.Platform, FromAgent
				return n
			}
		}
	}
	n.Version, n.Source = ImageVersion(c.Image), FromImage
	n.Note = fmt.Sprintf("the agent did not answer GET /%s on port %d (%v): version of its image", Path, port, err)
	return n
}

// agentContainer is the pod's container with the metrics port (else its first) and
// that port (else DefaultPort).
func agentContainer(pod *corev1.Pod) (corev1.Container, int) {
	for _, c := range pod.Spec.Containers {
		for _, p := range c.Ports {
			if p.Name == PortName {
				return c, int(p.ContainerPort)
			}
		}
	}
	if len(pod.Spec.Containers) == 0 {
		return corev1.Container{}, DefaultPort
	}
	return pod.Spec.Containers[0], DefaultPort
}

// ImageVersion is the version an image reference names: its tag, else its digest,
// else "unknown" (an untagged reference means "latest" to the runtime, not a version).
func ImageVersion(image string) string {
	if name, digest, ok := strings.Cut(image, "@"); ok {
		if tag := tagOf(name); tag != "" {
			return tag
		}
		return digest
	}
	if tag := tagOf(image); tag != "" {
		return tag
	}
	return "unknown"
}

// tagOf is the tag of name[:tag] (a ":" after the last "/": not a registry port).
func tagOf(ref string) string {
	i := strings.LastIndex(ref, ":")
	if i < 0 || strings.Contains(ref[i:], "/") {
		return ""
	}
	return ref[i+1:]
}
