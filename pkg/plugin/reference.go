package plugin

// ConfigKey documents one key of meshcni's entry in a CNI configuration list.
// docs/reference.md is generated from ConfigKeys (internal/tools/refdoc); a test checks
// that every JSON field ParseConfig reads is listed.
type ConfigKey struct {
	Key     string
	Values  string
	Default string
	Doc     string
}

// ConfigKeys lists every key ParseConfig reads.
var ConfigKeys = []ConfigKey{
	{"type", "`meshcni`", "", "The plugin's type; the agent writes it."},
	{"plugin_log_level", "`debug`, `info`, `warn`, `error`", "`info`", "Level of the plugin's log lines (sent to the agent's socket, else stderr)."},
	{"cni_agent_run_dir", "absolute path", "", "The agent's run dir: `" + KubeconfigName + "` and `agent.sock` live here. This or `kubernetes.kubeconfig` is required."},
	{"exclude_namespaces", "list of namespace names", "`[]`", "Pods in these namespaces are passed through without reading the kubeconfig or calling the API."},
	{"backend", "`auto`, `nftables`, `iptables-nft`, `iptables-legacy` (`iptables` = `iptables-nft`)", "`auto`", "How rules are written. `auto`: the backend already holding meshcni's rules in the pod, else native nftables."},
	{"native_nftables", "`true`, `false`", "`false`", "Istio's spelling of `backend: nftables`; conflicts with an iptables backend."},
	{"api_timeout", "Go duration (`\"10s\"`) or seconds, ≤ 5m", "`20s`", "Total deadline of the pod lookup, retries included."},
	{"agent_pod_namespace", "namespace name", "none (the agent writes its own)", "The agent's namespace: pods there with `agent_pod_label` are never redirected. Unset: no pod is exempt by label."},
	{"agent_pod_label", "`key=value`", "`app.kubernetes.io/name=meshcni`", "Label of the agent's own pods, never redirected in `agent_pod_namespace` (a label alone is no opt-out)."},
	{"ipv6", "`istio`, `capture`, `drop`", "`istio`", "What happens to a meshed pod's IPv6, the same on every backend (a pod's `meshcni.io/ipv6` annotation wins): `istio` captures it when Istio writes IPv6 rules (the proxy has `ISTIO_DUAL_STACK=true` and the pod an IPv6 address, or the pod is IPv6-only) and lets it pass otherwise; `capture` always captures it; `drop` drops what `istio` lets pass, except over lo, ICMPv6, the proxy's own outbound traffic and established or related flows."},
	{"kubernetes.kubeconfig", "absolute path", "", "Istio's legacy block: overrides `cni_agent_run_dir/" + KubeconfigName + "`."},
	{"kubernetes.exclude_namespaces", "list of namespace names", "`[]`", "Istio's legacy block: merged with `exclude_namespaces`."},
	{"kubernetes.cni_bin_dir", "absolute path", "", "Istio's legacy block: accepted and unused."},
}
