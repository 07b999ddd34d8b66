package plugin

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/cniconf"
	"github.com/meshcni/meshcni/pkg/podget"
	"github.com/meshcni/meshcni/pkg/spec"
)

// KubeconfigName is the kubeconfig the agent writes into cni_agent_run_dir.
const KubeconfigName = "meshcni-kubeconfig"

// Limits of api_timeout.
const (
	DefaultAPITimeout = 20 * time.Second
	MaxAPITimeout     = podget.MaxTimeout
)

// rawConfig is the JSON of meshcni's entry: the agent's cniconf.PluginEntry, plus the
// fields an operator may add by hand. Its "kubernetes" object (Istio's legacy block)
// shadows PluginEntry's to also accept its exclude_namespaces.
type rawConfig struct {
	cniconf.PluginEntry
	Kubernetes struct {
		cniconf.Kubernetes
		ExcludeNamespaces []string `json:"exclude_namespaces"`
	} `json:"kubernetes"`
	NativeNftables *bool           `json:"native_nftables"`
	APITimeout     json.RawMessage `json:"api_timeout"`
	AgentPodLabel  string          `json:"agent_pod_label"`
	IPv6           string          `json:"ipv6"`

	// types.PluginConf's fields but the prevResult, kept raw: only ADD and CHECK
	// decode it (DEL, STATUS and GC neither need it nor fail on it).
	CNIVersion   string          `json:"cniVersion"`
	Name         string          `json:"name"`
	Capabilities map[string]bool `json:"capabilities"`
	PrevResult   json.RawMessage `json:"prevResult"`
}

// Config is meshcni's parsed, typed configuration (one CNI invocation's stdin).
type Config struct {
	types.PluginConf // cniVersion, name, type, prevResult (parsed into PrevResult)

	LogLevel          slog.Level
	AgentRunDir       string // "" when not set
	Kubeconfig        string // the resolved kubeconfig path
	ExcludeNamespaces []string
	Backend           backend.Kind
	APITimeout        time.Duration
	AgentNamespace    string // "": no pod is exempt by the agent label
	AgentLabel        capture.Label
	IPv6              spec.IPv6Mode // the node's IPv6 mode; a pod's meshcni.io/ipv6 wins
}

// CaptureConfig is the decision's view of the configuration.
func (c *Config) CaptureConfig() capture.Config {
	return capture.Config{ExcludeNamespaces: c.ExcludeNamespaces, AgentNamespace: c.AgentNamespace, AgentLabel: c.AgentLabel, IPv6: c.IPv6}
}

func badField(field string, value any, reason string) *types.Error {
	return types.NewError(types.ErrInvalidNetworkConfig,
		fmt.Sprintf("meshcni config: invalid %s %v: %s", field, value, reason), "")
}

// ParseConfig parses meshcni's configuration from a CNI invocation's stdin. A
// malformed document is types.ErrDecodingFailure, a bad value
// types.ErrInvalidNetworkConfig; either message names the field. The prevResult,
// when present, is parsed into PrevResult (see RequirePrevResult).
func ParseConfig(stdin []byte) (*Config, error) { return parseConfig(stdin, true) }

// parseConfig is ParseConfig; without withPrev the prevResult is neither decoded nor
// checked (DEL: it must not fail on it, and a DEL is cheaper without).
func parseConfig(stdin []byte, withPrev bool) (*Config, error) {
	c := &Config{}
	var raw rawConfig
	if err := json.Unmarshal(stdin, &raw); err != nil {
		return nil, types.NewError(types.ErrDecodingFailure, "meshcni config: "+describeJSONError(err), "")
	}
	c.PluginConf = types.PluginConf{CNIVersion: raw.CNIVersion, Name: raw.Name, Type: raw.Type, Capabilities: raw.Capabilities}
	if raw.Type != "" && raw.Type != cniconf.PluginType {
		return nil, badField("type", strconv.Quote(raw.Type), "want \"meshcni\"")
	}

	switch strings.ToLower(strings.TrimSpace(raw.PluginLogLevel)) {
	case "", "info":
		c.LogLevel = slog.LevelInfo
	case "debug":
		c.LogLevel = slog.LevelDebug
	case "warn", "warning":
		c.LogLevel = slog.LevelWarn
	case "error":
		c.LogLevel = slog.LevelError
	default:
		return nil, badField("plugin_log_level", strconv.Quote(raw.PluginLogLevel), "want debug, info, warn or error")
	}

	for _, p := range []struct{ name, v string }{
		{"cni_agent_run_dir", raw.CNIAgentRunDir},
		{"kubernetes.kubeconfig", raw.Kubernetes.Kubeconfig},
	} {
		if p.v != "" && !filepath.IsAbs(p.v) {
			return nil, badField(p.name, strconv.Quote(p.v), "want an absolute path")
		}
	}
	c.AgentRunDir = filepath.Clean(raw.CNIAgentRunDir)
	if raw.CNIAgentRunDir == "" {
		c.AgentRunDir = ""
	}
	switch {
	case raw.Kubernetes.Kubeconfig != "":
		c.Kubeconfig = filepath.Clean(raw.Kubernetes.Kubeconfig)
	case c.AgentRunDir != "":
		c.Kubeconfig = filepath.Join(c.AgentRunDir, KubeconfigName)
	default:
		return nil, badField("cni_agent_run_dir", `""`, "set cni_agent_run_dir (where meshcni-agent writes "+KubeconfigName+") or kubernetes.kubeconfig")
	}

	seen := map[string]bool{}
	for _, list := range [][]string{raw.ExcludeNamespaces, raw.Kubernetes.ExcludeNamespaces} {
		for _, ns := range list {
			if !cniconf.IsNamespaceName(ns) {
				return nil, badField("exclude_namespaces", strconv.Quote(ns), "not a valid namespace name")
			}
			if !seen[ns] {
				seen[ns] = true
				c.ExcludeNamespaces = append(c.ExcludeNamespaces, ns)
			}
		}
	}

	b, err := parseBackend(raw.Backend)
	if err != nil {
		return nil, badField("backend", strconv.Quote(raw.Backend), err.Error())
	}
	if raw.NativeNftables != nil && *raw.NativeNftables {
		if b != backend.Auto && b != backend.Nftables {
			return nil, badField("native_nftables", true, fmt.Sprintf("conflicts with backend %q", raw.Backend))
		}
		b = backend.Nftables
	}
	c.Backend = b

	if c.APITimeout, err = parseTimeout(raw.APITimeout); err != nil {
		return nil, badField("api_timeout", string(raw.APITimeout), err.Error())
	}

	if ns := raw.AgentPodNamespace; ns != "" {
		if !cniconf.IsNamespaceName(ns) {
			return nil, badField("agent_pod_namespace", strconv.Quote(ns), "not a valid namespace name")
		}
		c.AgentNamespace = ns
	}
	c.AgentLabel, _ = capture.ParseLabel(capture.DefaultAgentLabel)
	if raw.AgentPodLabel != "" {
		if c.AgentLabel, err = capture.ParseLabel(raw.AgentPodLabel); err != nil {
			return nil, badField("agent_pod_label", strconv.Quote(raw.AgentPodLabel), err.Error())
		}
	}

	c.IPv6 = spec.IPv6Istio
	if raw.IPv6 != "" {
		if c.IPv6, err = spec.ParseIPv6Mode("ipv6", raw.IPv6); err != nil {
			return nil, badField("ipv6", strconv.Quote(raw.IPv6), "want istio, capture or drop")
		}
	}

	if !withPrev || len(raw.PrevResult) == 0 || string(raw.PrevResult) == "null" {
		return c, nil
	}
	if err := json.Unmarshal(raw.PrevResult, &c.RawPrevResult); err != nil {
		return nil, types.NewError(types.ErrDecodingFailure, "meshcni config: prevResult: "+describeJSONError(err), "")
	}
	if err := version.ParsePrevResult(&c.PluginConf); err != nil {
		return nil, types.NewError(types.ErrDecodingFailure, "meshcni config: prevResult: "+err.Error(), "")
	}
	return c, nil
}

// parseBackend accepts backend.ParseKind's names plus "iptables" (cniconf's name for
// "iptables, as the node runs it"), which selects iptables-nft.
func parseBackend(s string) (backend.Kind, error) {
	if strings.EqualFold(strings.TrimSpace(s), "iptables") {
		return backend.IptablesNft, nil
	}
	k, err := backend.ParseKind(s)
	if err != nil {
		return "", errors.New("want auto, nftables, iptables-nft, iptables-legacy or iptables")
	}
	return k, nil
}

// parseTimeout takes a Go duration string ("5s") or a number of seconds.
func parseTimeout(raw json.RawMessage) (time.Duration, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return DefaultAPITimeout, nil
	}
	var d time.Duration
	var s string
	var f float64
	switch {
	case json.Unmarshal(raw, &s) == nil:
		var err error
		if d, err = time.ParseDuration(strings.TrimSpace(s)); err != nil {
			return 0, errors.New("want a duration such as \"10s\" or a number of seconds")
		}
	case json.Unmarshal(raw, &f) == nil:
		d = time.Duration(f * float64(time.Second))
	default:
		return 0, errors.New("want a duration such as \"10s\" or a number of seconds")
	}
	if d <= 0 || d > MaxAPITimeout {
		return 0, fmt.Errorf("want more than 0 and at most %s", MaxAPITimeout)
	}
	return d, nil
}

// describeJSONError says where a JSON document is wrong.
func describeJSONError(err error) string {
	var se *json.SyntaxError
	var te *json.UnmarshalTypeError
	switch {
	case errors.As(err, &se):
		return fmt.Sprintf("malformed JSON at byte %d: %v", se.Offset, se)
	case errors.As(err, &te):
		field := te.Field
		if field == "" {
			field = "(document)"
		}
		return fmt.Sprintf("field %s: got JSON %s, want %s", field, te.Value, te.Type)
	}
	return "malformed JSON: " + err.Error()
}
