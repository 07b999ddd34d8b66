package capture

// Setting documents one pod-level input meshcni reads: an annotation, a label or an
// environment variable of the istio-proxy container. docs/reference.md is generated
// from Settings (internal/tools/refdoc).
type Setting struct {
	Key     string
	Where   string // "annotation", "label or annotation", "istio-proxy env"
	Default string // what applies when absent
	Doc     string
}

// Settings lists every pod-level input, in the order the decision and Build read them.
var Settings = []Setting{
	{AnnotationStatus, "annotation", "absent: not meshed", "Set by Istio's sidecar injector. Its presence (any value) marks the pod as injected; without it meshcni leaves the pod alone."},
	{AnnotationInject, "label or annotation", "true", "`false` opts the pod out. The label wins over the annotation."},
	{AnnotationInterceptionMode, "annotation", "REDIRECT", "`REDIRECT` (NAT) or `TPROXY` (transparent proxy, keeps the source address); `NONE` means no capture and the pod is not redirected."},
	{AnnotationIncludeInboundPorts, "annotation", defaultIncludeInboundPorts, "Inbound ports captured to 15006: `*` for all, or a comma-separated list. Empty captures no inbound traffic."},
	{AnnotationExcludeInboundPorts, "annotation", defaultExcludeInboundPorts, "Inbound ports not captured, used with `*`. 15020, 15021 and 15090 are always added."},
	{AnnotationIncludeOutboundPorts, "annotation", "(none)", "Outbound ports captured to 15001 even when their destination is not in the included CIDRs."},
	{AnnotationExcludeOutboundPorts, "annotation", defaultExcludeOutboundPorts, "Outbound ports never captured. A present annotation replaces the default, so 15020 is then not excluded unless listed."},
	{AnnotationIncludeOutboundIPRanges, "annotation", defaultIncludeIPRanges, "Outbound destination CIDRs captured: `*` for all, or a comma-separated list of IPv4/IPv6 CIDRs. Empty captures only includeOutboundPorts."},
	{AnnotationExcludeOutboundIPRanges, "annotation", "(none)", "Outbound destination CIDRs never captured."},
	{AnnotationExcludeInterfaces, "annotation", "(none)", "Comma-separated interface names whose traffic is never captured."},
	{AnnotationRerouteVirtualInterfaces, "annotation", "(none)", "Comma-separated interfaces (e.g. KubeVirt's) whose inbound traffic is captured as outbound."},
	{AnnotationKubevirtInterfaces, "annotation", "(none)", "Deprecated spelling of " + AnnotationRerouteVirtualInterfaces + ", which wins when both are set."},
	{EnvDNSCapture, "istio-proxy env", "false", "`true` captures DNS (UDP and TCP port 53) to the proxy's DNS port 15053."},
	{EnvDualStack, "istio-proxy env", "false", "`true`: IPv6 is captured when the pod has an IPv6 address. Without it IPv6 is captured only in an IPv6-only pod, as Istio decides (istio-iptables' getLocalIP); a dual-stack pod's IPv6 then passes uncaptured, unless " + AnnotationIPv6 + " says otherwise."},
	{EnvInvalidDrop, "istio-proxy env", "false", "`true` drops packets conntrack marks INVALID."},
	{EnvDisableEnvoy, "istio-proxy env", "false", "`true`: the proxy does not run, the pod is not redirected."},
	{AnnotationIPv6, "annotation", "istio", "meshcni's own; absent: the plugin's `ipv6` key (default `istio`). What happens to the pod's IPv6, the same on every backend: `istio` captures it exactly when Istio writes IPv6 rules (above) and lets it pass uncaptured otherwise; `capture` always captures it (the proxy must listen on IPv6: `[::1]:15001`, 15006); `drop` is `istio`, but IPv6 that would pass is dropped, except over lo, ICMPv6, the proxy's own (UID/GID) outbound traffic and established or related flows. Another value fails the pod's ADD with an error naming the annotation."},
	{AnnotationEBPFAcceleration, "annotation", "off", "meshcni's own: eBPF acceleration of the hop between the app and its proxy inside the pod (docs/ebpf.md), on a node whose agent loads it (`--ebpf-acceleration auto`). `off`; `to-proxy` accelerates what the app sends to the proxy; `both` also what the proxy sends to the app (not for apps that read with splice(2)). Absent: `to-proxy` in the agent's `--ebpf-namespaces`, else `--ebpf-default` (default `off`). Another value fails the pod's ADD with an error naming the annotation."},
	{"securityContext.runAsUser / runAsGroup", "istio-proxy container", "1337", "The proxy's UID/GID, whose traffic is exempt from capture. 0 or unset means 1337."},
}
