// Package capture decides whether, and in which mode, meshcni captures a pod's traffic
// (one mode: ModeSidecar, the pod has an Istio sidecar whose traffic meshcni
// redirects) and derives its redirect spec from the pod's annotations, the istio-proxy
// container and Istio's defaults, exactly as istio-cni's sidecar plugin does
// (cni/pkg/plugin/redirect.go). It is pure: no effects, no API calls.
package capture

import (
	"fmt"
	"net/netip"
	"strconv"
	"strings"

	"github.com/meshcni/meshcni/pkg/spec"
)

// Istio's names: containers, annotations, labels and proxy environment variables.
const (
	ProxyContainer = "istio-proxy"
	InitContainer  = "istio-init"

	AnnotationStatus           = "sidecar.istio.io/status"
	AnnotationInject           = "sidecar.istio.io/inject" // also a label; the label wins
	AnnotationInterceptionMode = "sidecar.istio.io/interceptionMode"

	AnnotationIncludeInboundPorts      = "traffic.sidecar.istio.io/includeInboundPorts"
	AnnotationExcludeInboundPorts      = "traffic.sidecar.istio.io/excludeInboundPorts"
	AnnotationIncludeOutboundPorts     = "traffic.sidecar.istio.io/includeOutboundPorts"
	AnnotationExcludeOutboundPorts     = "traffic.sidecar.istio.io/excludeOutboundPorts"
	AnnotationIncludeOutboundIPRanges  = "traffic.sidecar.istio.io/includeOutboundIPRanges"
	AnnotationExcludeOutboundIPRanges  = "traffic.sidecar.istio.io/excludeOutboundIPRanges"
	AnnotationExcludeInterfaces        = "traffic.sidecar.istio.io/excludeInterfaces"
	AnnotationRerouteVirtualInterfaces = "istio.io/reroute-virtual-interfaces"
	// AnnotationKubevirtInterfaces is deprecated in favour of
	// AnnotationRerouteVirtualInterfaces, which wins when both are set.
	AnnotationKubevirtInterfaces = "traffic.sidecar.istio.io/kubevirtInterfaces"

	// AnnotationIPv6 is meshcni's own: the pod's IPv6 mode (spec.IPv6Mode: istio,
	// capture or drop), overriding the plugin's ipv6 key.
	AnnotationIPv6 = "meshcni.io/ipv6"

	EnvDNSCapture   = "ISTIO_META_DNS_CAPTURE"
	EnvDualStack    = "ISTIO_DUAL_STACK"
	EnvInvalidDrop  = "INVALID_DROP"
	EnvDisableEnvoy = "DISABLE_ENVOY"

	// DefaultAgentLabel selects the node agent's own pods, which are never redirected.
	DefaultAgentLabel = "app.kubernetes.io/name=meshcni"
)

// Istio's per-annotation defaults when the annotation is absent (redirect.go's
// annotationRegistry). A present annotation replaces the default, even when empty.
const (
	defaultIncludeInboundPorts  = "*"
	defaultExcludeInboundPorts  = "15020" // then 15020,15021,15090 are always appended
	defaultIncludeOutboundPorts = ""
	defaultExcludeOutboundPorts = "15020" // the status port; replaced by the annotation
	defaultIncludeIPRanges      = "*"
	defaultExcludeIPRanges      = ""
)

// Label is one key=value label selector.
type Label struct{ Key, Value string }

// ParseLabel parses "key=value" (a bare "key" matches any value).
func ParseLabel(s string) (Label, error) {
	k, v, _ := strings.Cut(strings.TrimSpace(s), "=")
	k, v = strings.TrimSpace(k), strings.TrimSpace(v)
	if k == "" || strings.ContainsAny(k, " ,") || strings.ContainsAny(v, " ,=") {
		return Label{}, fmt.Errorf("invalid label selector %q: want key=value", s)
	}
	return Label{Key: k, Value: v}, nil
}

// Matches reports whether the labels carry this label.
func (l Label) Matches(labels map[string]string) bool {
	v, ok := labels[l.Key]
	return ok && (l.Value == "" || v == l.Value)
}

func (l Label) String() string { return l.Key + "=" + l.Value }

// Config is what the decision needs besides the pod.
type Config struct {
	ExcludeNamespaces []string
	// AgentNamespace is the node agent's namespace; its pods there that carry
	// AgentLabel are never redirected. Empty: no pod is exempt by label (a label
	// alone, which any workload can carry, is no opt-out).
	AgentNamespace string
	// AgentLabel selects the node agent's pods (zero: DefaultAgentLabel).
	AgentLabel Label
	// IPv6 is the node's IPv6 mode (the plugin's ipv6 key), for pods without the
	// AnnotationIPv6 annotation (zero: spec.IPv6Istio).
	IPv6 spec.IPv6Mode
}

// Mode is how meshcni captures a pod's traffic.
type Mode string

const (
	// ModeNone: meshcni leaves the pod's traffic alone.
	ModeNone Mode = ""
	// ModeSidecar: the pod's traffic is redirected in its network namespace to its
	// Istio sidecar (istio-proxy).
	ModeSidecar Mode = "sidecar"
)

// Decision says how a pod's traffic is captured (Mode; ModeNone: not at all), and why.
type Decision struct {
	Mode   Mode
	Reason string
}

// Captured reports whether meshcni captures the pod's traffic in some mode.
func (d Decision) Captured() bool { return d.Mode != ModeNone }

func skip(format string, args ...any) Decision {
	return Decision{Reason: fmt.Sprintf(format, args...)}
}

// ExcludedNamespace reports whether ns is in the excluded list.
func (c Config) ExcludedNamespace(ns string) bool {
	for _, e := range c.ExcludeNamespaces {
		if e == ns {
			return true
		}
	}
	return false
}

// Decide says whether the pod gets meshcni's redirect: it must have an istio-proxy
// sidecar (a regular container, or a native-sidecar init container with
// restartPolicy Always) injected by Istio (sidecar.istio.io/status), must not opt out
// (sidecar.istio.io/inject=false; the label wins over the annotation), must not carry
// istio-init (that container redirects by itself), and its proxy must be an enabled
// sidecar (not DISABLE_ENVOY, not a router/gateway, interception mode not NONE).
func Decide(pod *Pod, cfg Config) Decision {
	if pod == nil {
		return skip("no pod")
	}
	if cfg.ExcludedNamespace(pod.Namespace) {
		return skip("namespace %s is excluded", pod.Namespace)
	}
	agent := cfg.AgentLabel
	if agent.Key == "" {
		agent, _ = ParseLabel(DefaultAgentLabel)
	}
	if cfg.AgentNamespace != "" && pod.Namespace == cfg.AgentNamespace && agent.Matches(pod.Labels) {
		return skip("pod is meshcni's own (namespace %s, label %s)", cfg.AgentNamespace, agent)
	}
	proxy, native := FindProxy(pod)
	if proxy == nil {
		return skip("no %s container", ProxyContainer)
	}
	if _, ok := pod.Annotations[AnnotationStatus]; !ok {
		return skip("no %s annotation: the sidecar was not injected by Istio", AnnotationStatus)
	}
	if v, ok := pod.Labels[AnnotationInject]; ok {
		if b, err := strconv.ParseBool(v); err == nil && !b {
			return skip("label %s=%s", AnnotationInject, v)
		}
	} else if v, ok := pod.Annotations[AnnotationInject]; ok {
		if b, err := strconv.ParseBool(v); err == nil && !b {
			return skip("annotation %s=%s", AnnotationInject, v)
		}
	}
	for _, c := range pod.Spec.InitContainers {
		if c.Name == InitContainer {
			return skip("pod has an %s container, which applies the redirect itself", InitContainer)
		}
	}
	env := proxyEnv(proxy)
	if v, ok := env[EnvDisableEnvoy]; ok {
		if b, err := strconv.ParseBool(v); err == nil && b {
			return skip("%s=%s on %s", EnvDisableEnvoy, v, ProxyContainer)
		}
	}
	if t := proxyType(proxy); t != "" && t != "sidecar" {
		return skip("%s is a %q proxy, not a sidecar", ProxyContainer, t)
	}
	if m := strings.TrimSpace(pod.Annotations[AnnotationInterceptionMode]); strings.EqualFold(m, "NONE") {
		return skip("%s=%s: the proxy captures no traffic", AnnotationInterceptionMode, m)
	}
	kind := "sidecar container"
	if native {
		kind = "native sidecar (init container, restartPolicy Always)"
	}
	return Decision{Mode: ModeSidecar, Reason: fmt.Sprintf("%s %s injected by Istio", ProxyContainer, kind)}
}

// FindProxy returns the istio-proxy container and whether it is a native sidecar.
// An istio-proxy init container counts only with restartPolicy Always.
func FindProxy(pod *Pod) (c *Container, native bool) {
	for i := range pod.Spec.Containers {
		if pod.Spec.Containers[i].Name == ProxyContainer {
			return &pod.Spec.Containers[i], false
		}
	}
	for i := range pod.Spec.InitContainers {
		ic := &pod.Spec.InitContainers[i]
		if ic.Name == ProxyContainer && ic.RestartPolicy != nil && *ic.RestartPolicy == ContainerRestartPolicyAlways {
			return ic, true
		}
	}
	return nil, false
}

// proxyType is istio-proxy's role from its args ("proxy sidecar ..." or "proxy router").
func proxyType(c *Container) string {
	args := c.Args
	if len(args) >= 2 && args[0] == "proxy" {
		return args[1]
	}
	return ""
}

// proxyEnv holds the istio-proxy container's literal environment values (valueFrom
// entries cannot be resolved here and are left out, as istio-cni does).
func proxyEnv(c *Container) map[string]string {
	env := make(map[string]string, len(c.Env))
	for _, e := range c.Env {
		if e.ValueFrom == nil {
			env[e.Name] = e.Value
		}
	}
	return env
}

// Result is a derived spec plus the non-fatal findings along the way.
type Result struct {
	Spec *spec.Spec
	// Warnings lists values istio-cni ignores with a warning (unparseable booleans in
	// the proxy's environment); meshcni ignores them the same way and logs them.
	Warnings []string
	// EBPF is the pod's meshcni.io/ebpf-acceleration (AccelDefault without it).
	EBPF Acceleration
}

// Spec derives the pod's redirect spec. See Build.
func Spec(pod *Pod) (*spec.Spec, error) {
	r, err := Build(pod)
	if err != nil {
		return nil, err
	}
	return r.Spec, nil
}

// Build derives a meshed pod's redirect spec the way istio-cni does:
//
//   - outbound to 15001, inbound to 15006, tunnel 15008 (not configurable per pod);
//   - proxy UID/GID from istio-proxy's securityContext.runAsUser/runAsGroup (0 or
//     unset: 1337);
//   - interception mode from sidecar.istio.io/interceptionMode (default REDIRECT);
//   - inbound ports to capture from includeInboundPorts (default "*"); inbound ports
//     excluded: excludeInboundPorts (default "15020") plus 15020,15021,15090 always;
//   - outbound ports from includeOutboundPorts (default none) and excludeOutboundPorts
//     (default "15020"; a present annotation replaces it, 15020 is then not added);
//   - outbound CIDRs from includeOutboundIPRanges (default "*") and
//     excludeOutboundIPRanges (default none);
//   - excludeInterfaces, and the virtual interfaces from
//     istio.io/reroute-virtual-interfaces (or the deprecated kubevirtInterfaces);
//   - ISTIO_META_DNS_CAPTURE → DNS capture, of all DNS (the pod's resolv.conf is not
//     known to a CNI plugin, so istio-cni captures all port-53 traffic);
//     INVALID_DROP → drop conntrack-INVALID; ISTIO_DUAL_STACK → IPv6 rules (the
//     plugin then sets the families from the pod's actual addresses as Istio does,
//     see WithFamilies);
//   - meshcni.io/ipv6 (meshcni's own) → the IPv6 mode, else the node's (Config.IPv6),
//     else istio;
//   - meshcni.io/ebpf-acceleration (meshcni's own) → Result.EBPF.
//
// A present annotation with a bad value is an error (a *spec.FieldError naming the
// annotation and the value); nothing must be applied then.
func Build(pod *Pod) (Result, error) { return Config{}.Build(pod) }

// Build is the package's Build with the node's settings (Config.IPv6).
func (c Config) Build(pod *Pod) (Result, error) {
	if pod == nil {
		return Result{}, fmt.Errorf("no pod")
	}
	s := spec.PodDefaults()
	var res Result
	ann := pod.Annotations
	var err error
	if s.IPv6, err = c.ipv6(ann); err != nil {
		return Result{}, err
	}
	if res.EBPF, err = acceleration(ann); err != nil {
		return Result{}, err
	}
	get := func(key, def string) string {
		if v, ok := ann[key]; ok {
			return v
		}
		return def
	}
	if v, ok := ann[AnnotationInterceptionMode]; ok {
		if s.Mode, err = spec.ParseMode(AnnotationInterceptionMode, v); err != nil {
			return Result{}, err
		}
	}
	if s.InboundPorts, err = spec.ParsePortSet(AnnotationIncludeInboundPorts, get(AnnotationIncludeInboundPorts, defaultIncludeInboundPorts)); err != nil {
		return Result{}, err
	}
	excl, err := spec.ParseExcludePortList(AnnotationExcludeInboundPorts, get(AnnotationExcludeInboundPorts, defaultExcludeInboundPorts))
	if err != nil {
		return Result{}, err
	}
	s.InboundPortsExclude = appendUnique(excl, spec.DefaultExcludeInboundPorts...)
	if s.OutboundPorts, err = spec.ParsePortList(AnnotationIncludeOutboundPorts, get(AnnotationIncludeOutboundPorts, defaultIncludeOutboundPorts)); err != nil {
		return Result{}, err
	}
	if s.OutboundPortsExclude, err = spec.ParseExcludePortList(AnnotationExcludeOutboundPorts, get(AnnotationExcludeOutboundPorts, defaultExcludeOutboundPorts)); err != nil {
		return Result{}, err
	}
	if s.OutboundIPRanges, err = spec.ParsePrefixSet(AnnotationIncludeOutboundIPRanges, get(AnnotationIncludeOutboundIPRanges, defaultIncludeIPRanges)); err != nil {
		return Result{}, err
	}
	if v := get(AnnotationExcludeOutboundIPRanges, defaultExcludeIPRanges); strings.TrimSpace(v) == "*" {
		return Result{}, &spec.FieldError{Field: AnnotationExcludeOutboundIPRanges, Value: v, Reason: "'*' would exclude everything; list CIDRs"}
	}
	if s.OutboundIPRangesExclude, err = spec.ParsePrefixList(AnnotationExcludeOutboundIPRanges, get(AnnotationExcludeOutboundIPRanges, defaultExcludeIPRanges)); err != nil {
		return Result{}, err
	}
	if s.ExcludeInterfaces, err = spec.ParseInterfaceList(AnnotationExcludeInterfaces, ann[AnnotationExcludeInterfaces]); err != nil {
		return Result{}, err
	}
	if v, ok := ann[AnnotationRerouteVirtualInterfaces]; ok {
		if s.RerouteInterfaces, err = spec.ParseInterfaceList(AnnotationRerouteVirtualInterfaces, v); err != nil {
			return Result{}, err
		}
	} else if v, ok := ann[AnnotationKubevirtInterfaces]; ok {
		if s.RerouteInterfaces, err = spec.ParseInterfaceList(AnnotationKubevirtInterfaces, v); err != nil {
			return Result{}, err
		}
	}

	proxy, _ := FindProxy(pod)
	if proxy != nil {
		if sc := proxy.SecurityContext; sc != nil {
			if sc.RunAsUser != nil && *sc.RunAsUser != 0 {
				id, err := idOf(ProxyContainer+".securityContext.runAsUser", *sc.RunAsUser)
				if err != nil {
					return Result{}, err
				}
				s.ProxyUIDs = []uint32{id}
			}
			if sc.RunAsGroup != nil && *sc.RunAsGroup != 0 {
				id, err := idOf(ProxyContainer+".securityContext.runAsGroup", *sc.RunAsGroup)
				if err != nil {
					return Result{}, err
				}
				s.ProxyGIDs = []uint32{id}
			}
		}
		env := proxyEnv(proxy)
		envBool := func(name string) bool {
			v, ok := env[name]
			if !ok {
				return false
			}
			b, err := strconv.ParseBool(strings.TrimSpace(v))
			if err != nil {
				res.Warnings = append(res.Warnings, fmt.Sprintf("%s env %s=%q is not a boolean; ignored (as istio-cni does)", ProxyContainer, name, v))
				return false
			}
			return b
		}
		if envBool(EnvDNSCapture) {
			s.RedirectDNS, s.CaptureAllDNS = true, true
		}
		s.DropInvalid = envBool(EnvInvalidDrop)
		s.EnableIPv6 = envBool(EnvDualStack)
	}
	if err := s.Validate(); err != nil {
		return Result{}, fmt.Errorf("pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	res.Spec = &s
	return res, nil
}

// ipv6 is the pod's IPv6 mode: its annotation, else the node's, else istio.
func (c Config) ipv6(ann map[string]string) (spec.IPv6Mode, error) {
	if v, ok := ann[AnnotationIPv6]; ok {
		return spec.ParseIPv6Mode(AnnotationIPv6, v)
	}
	if c.IPv6 == "" {
		return spec.IPv6Istio, nil
	}
	return c.IPv6, nil
}

func idOf(field string, v int64) (uint32, error) {
	if v < 0 || v >= 1<<32-1 {
		return 0, &spec.FieldError{Field: field, Value: strconv.FormatInt(v, 10), Reason: "a UID/GID must be a whole number from 0 to 4294967294"}
	}
	return uint32(v), nil
}

func appendUnique(ports []uint16, more ...uint16) []uint16 {
	out := append([]uint16(nil), ports...)
	for _, p := range more {
		found := false
		for _, q := range out {
			if q == p {
				found = true
				break
			}
		}
		if !found {
			out = append(out, p)
		}
	}
	return out
}

// WithFamilies sets the spec's IP families from the pod's addresses (the CNI
// prevResult's IPs) as Istio decides them: IPv4 rules when the pod has an IPv4
// address; IPv6 rules (and ::6 on lo) as spec.IstioIPv6 says, given the proxy's
// ISTIO_DUAL_STACK, which s.EnableIPv6 holds on entry (Build sets it so). A
// dual-stack pod whose proxy is not dual-stack thus gets no IPv6 rules, as under
// istio-cni; what then happens to its IPv6 is the spec's IPv6 mode. With no
// address at all the spec is left as it is.
func WithFamilies(s *spec.Spec, addrs []netip.Addr) {
	var v4, v6 bool
	for _, a := range addrs {
		a = a.Unmap()
		if a.Is4() {
			v4 = true
		} else if a.Is6() {
			v6 = true
		}
	}
	if v4 || v6 {
		s.EnableIPv6 = spec.IstioIPv6(s.EnableIPv6, addrs)
		s.EnableIPv4 = v4 || !s.EnableIPv6
	}
}

// ForPod derives the pod's redirect spec (Build) and sets its IP families from the
// pod's addresses (WithFamilies): what the plugin applies at ADD, for callers that
// program a pod after the fact (the agent's repair controller). addrs are the pod's
// addresses (status.podIPs).
func ForPod(pod *Pod, addrs []netip.Addr) (Result, error) { return Config{}.ForPod(pod, addrs) }

// ForPod is the package's ForPod with the node's settings (Config.IPv6).
func (c Config) ForPod(pod *Pod, addrs []netip.Addr) (Result, error) {
	res, err := c.Build(pod)
	if err != nil {
		return Result{}, err
	}
	WithFamilies(res.Spec, addrs)
	return res, nil
}

// AnnotationMirror holds, on a static pod's mirror pod, the UID kubelet runs the
// static pod with (the mirror pod's own UID differs).
const AnnotationMirror = "kubernetes.io/config.mirror"

// IsRuntimePod reports whether pod is the one the container runtime is creating
// with uid (CNI's K8S_POD_UID): its own UID, or a static pod's through its mirror.
func IsRuntimePod(pod *Pod, uid string) bool {
	return pod.UID == uid || pod.Annotations[AnnotationMirror] == uid
}
