// Package cniconf finds the node's primary CNI network configuration the way kubelet
// and libcni do, and injects or removes meshcni's chained plugin entry, keeping the
// rest of the file semantically unchanged (key order and unknown fields included).
package cniconf

import (
	"bytes"
	"encoding/json"
	"fmt"
	"path/filepath"
)

// PluginType is the "type" of meshcni's entry in a CNI configuration list.
const PluginType = "meshcni"

// PluginEntry is meshcni's entry in a CNI configuration list. The agent writes it and
// the plugin reads it back from its stdin configuration: the JSON names are the
// contract between the two.
type PluginEntry struct {
	Type              string     `json:"type"`
	PluginLogLevel    string     `json:"plugin_log_level"`
	CNIAgentRunDir    string     `json:"cni_agent_run_dir"`
	ExcludeNamespaces []string   `json:"exclude_namespaces"`
	Backend           string     `json:"backend"`
	Kubernetes        Kubernetes `json:"kubernetes"`
	// AgentPodNamespace is the agent's own namespace: only there does the agent's
	// pod label exempt a pod from the redirect.
	AgentPodNamespace string `json:"agent_pod_namespace,omitempty"`
	// IPv6 is the node's IPv6 mode (istio, capture, drop); empty: istio. A pod's
	// meshcni.io/ipv6 annotation wins.
	IPv6 string `json:"ipv6,omitempty"`
}

// Kubernetes is the "kubernetes" object of PluginEntry.
type Kubernetes struct {
	Kubeconfig string `json:"kubeconfig"`
	CNIBinDir  string `json:"cni_bin_dir"`
}

// Values accepted in PluginEntry.
var (
	LogLevels = []string{"debug", "info", "warn", "error"}
	// Backends are backend.Kind's names plus "iptables", an alias of iptables-nft.
	Backends = []string{"auto", "nftables", "iptables-nft", "iptables-legacy", "iptables"}
)

// IsNamespaceName reports whether s is a valid Kubernetes namespace name (an RFC 1123
// label): it matches ^[a-z0-9]([-a-z0-9]*[a-z0-9])?$ and is at most 63 bytes long.
// A loop, not a regexp, because the CNI plugin links this package and a package-level
// regexp would be compiled at every plugin start.
func IsNamespaceName(s string) bool {
	if len(s) == 0 || len(s) > 63 || s[0] == '-' || s[len(s)-1] == '-' {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if (c < 'a' || c > 'z') && (c < '0' || c > '9') && c != '-' {
			return false
		}
	}
	return true
}

// Validate reports the first invalid field.
func (e PluginEntry) Validate() error {
	if e.Type != PluginType {
		return fmt.Errorf("plugin entry: type %q, want %q", e.Type, PluginType)
	}
	if !oneOf(e.PluginLogLevel, LogLevels) {
		return fmt.Errorf("plugin entry: plugin_log_level %q: want one of %v", e.PluginLogLevel, LogLevels)
	}
	if !oneOf(e.Backend, Backends) {
		return fmt.Errorf("plugin entry: backend %q: want one of %v", e.Backend, Backends)
	}
	for _, p := range []struct{ name, v string }{
		{"cni_agent_run_dir", e.CNIAgentRunDir},
		{"kubernetes.kubeconfig", e.Kubernetes.Kubeconfig},
		{"kubernetes.cni_bin_dir", e.Kubernetes.CNIBinDir},
	} {
		if !filepath.IsAbs(p.v) || filepath.Clean(p.v) != p.v {
			return fmt.Errorf("plugin entry: %s %q: want a clean absolute path", p.name, p.v)
		}
	}
	for _, ns := range e.ExcludeNamespaces {
		if !IsNamespaceName(ns) {
			return fmt.Errorf("plugin entry: exclude_namespaces: %q is not a valid namespace name", ns)
		}
	}
	if e.AgentPodNamespace != "" && !IsNamespaceName(e.AgentPodNamespace) {
		return fmt.Errorf("plugin entry: agent_pod_namespace: %q is not a valid namespace name", e.AgentPodNamespace)
	}
	return nil
}

func oneOf(v string, set []string) bool {
	for _, s := range set {
		if v == s {
			return true
		}
	}
	return false
}

// Marshal encodes the entry as compact JSON without HTML escaping.
func (e PluginEntry) Marshal() ([]byte, error) {
	if e.ExcludeNamespaces == nil {
		e.ExcludeNamespaces = []string{}
	}
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(e); err != nil {
		return nil, fmt.Errorf("encode plugin entry: %w", err)
	}
	return bytes.TrimSpace(buf.Bytes()), nil
}
