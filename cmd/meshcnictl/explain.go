package main

import (
	"context"
	"fmt"
	"io"
	"net/netip"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/capture/k8spod"
	"github.com/meshcni/meshcni/pkg/meshcnictl/kubeget"
	"github.com/meshcni/meshcni/pkg/meshcnictl/output"
	"github.com/meshcni/meshcni/pkg/podnetns"
	"github.com/meshcni/meshcni/pkg/rules"
	"github.com/meshcni/meshcni/pkg/rules/ipt"
	"github.com/meshcni/meshcni/pkg/spec"
)

func init() { subcommands = append(subcommands, newExplainCmd) }

type explainFlags struct {
	file              string
	kubeconfig        string
	namespace         string
	excludeNamespaces []string
	agentNamespace    string
	agentLabel        string
	ipv6Mode          string
	podIPs            []string
	timeout           time.Duration
	output            string
}

func newExplainCmd() *cobra.Command {
	f := &explainFlags{}
	cmd := &cobra.Command{
		Use:   "explain [POD]",
		Short: "Say whether meshcni redirects a pod, why, and with which rules",
		Long: `explain runs the CNI plugin's own decision and rule derivation on a pod and
prints what the plugin does when the pod starts: redirected or not, the reason, the
redirect settings it takes from the pod's annotations and its istio-proxy container,
and the rules it writes (in iptables-restore form). The pod is read from a file (-f,
YAML or JSON, "-" for stdin) or from the API server ([NAMESPACE/]POD or -n NAMESPACE
POD; the namespace defaults to the kubeconfig context's; --kubeconfig, default
$KUBECONFIG, then the in-cluster service account). Nothing is changed.

IP families: the pod's addresses are --pod-ip (as the plugin takes them from the CNI
result), else the pod's status.podIPs; IPv6 is captured as Istio decides (with
ISTIO_DUAL_STACK on istio-proxy when the pod has an IPv6 address, without it only
in an IPv6-only pod), or as the pod's meshcni.io/ipv6 (else --ipv6-mode, the
plugin's ipv6 key) says.

-o json or -o yaml prints a PodRedirectExplanation (apiVersion meshcni.io/v1alpha1)
with the same content.`,
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx, cancel := context.WithTimeout(cmd.Context(), f.timeout)
			defer cancel()
			if _, err := output.ParseFormat(f.output); err != nil {
				return err
			}
			pod, err := f.pod(ctx, args)
			if err != nil {
				return err
			}
			return explain(cmd.OutOrStdout(), pod, f)
		},
	}
	fl := cmd.Flags()
	fl.StringVarP(&f.file, "file", "f", "", "pod manifest (YAML or JSON); - for stdin")
	f.registerPodFlags(fl) // shared with inspect
	fl.StringSliceVar(&f.podIPs, "pod-ip", nil, "the pod's addresses, which set the IP families of the rules (default: the pod's status.podIPs)")
	fl.StringVarP(&f.output, "output", "o", "text", "output format: text, json or yaml")
	return cmd
}

func (f *explainFlags) pod(ctx context.Context, args []string) (*corev1.Pod, error) {
	switch {
	case f.file != "" && len(args) > 0:
		return nil, fmt.Errorf("give either -f or a pod name, not both")
	case f.file != "":
		var data []byte
		var err error
		if f.file == "-" {
			data, err = io.ReadAll(os.Stdin)
		} else {
			data, err = os.ReadFile(f.file)
		}
		if err != nil {
			return nil, fmt.Errorf("read pod manifest: %w", err)
		}
		var pod corev1.Pod
		if err := yaml.Unmarshal(data, &pod); err != nil {
			return nil, fmt.Errorf("parse pod manifest %s: %w", f.file, err)
		}
		if pod.Kind != "" && pod.Kind != "Pod" {
			return nil, fmt.Errorf("%s holds a %s, want a Pod", f.file, pod.Kind)
		}
		return &pod, nil
	case len(args) == 1:
		ns, name, err := f.podRef(args[0])
		if err != nil {
			return nil, err
		}
		return getPod(ctx, f.kubeconfig, ns, name)
	}
	return nil, fmt.Errorf("give a pod: -f FILE or -n NAMESPACE POD")
}

// podRef parses [NAMESPACE/]NAME; the namespace defaults to -n, else to the
// kubeconfig context's namespace (in a pod without kubeconfig: its service
// account's).
func (f *explainFlags) podRef(ref string) (string, string, error) {
	if f.namespace == "" && !strings.Contains(ref, "/") {
		if _, _, err := podRef(ref, "default"); err != nil {
			return "", "", err // a bad name, whatever the namespace
		}
		ns, err := kubeget.Namespace(f.kubeconfig)
		if err != nil {
			return "", "", err
		}
		f.namespace = ns
	}
	return podRef(ref, f.namespace)
}

// explanation is explain's result for -o json|yaml.
type explanation struct {
	output.TypeMeta `json:",inline"`
	Pod             string               `json:"pod"` // namespace/name
	Redirected      bool                 `json:"redirected"`
	Reason          string               `json:"reason"`
	Warnings        []string             `json:"warnings,omitempty"`
	Spec            *output.RedirectSpec `json:"spec,omitempty"`
	Rules           *ruleText            `json:"rules,omitempty"`
}

// ruleText is the rules the plugin writes, in iptables-restore --noflush form per
// family, and its policy route (TPROXY).
type ruleText struct {
	IPv4        string `json:"ipv4,omitempty"`
	IPv6        string `json:"ipv6,omitempty"`
	PolicyRoute string `json:"policyRoute,omitempty"`
}

// explanationKind is the kind of explain's -o json|yaml result.
const explanationKind = "PodRedirectExplanation"

func newExplanation(pod *corev1.Pod, p podPlan) explanation {
	e := explanation{TypeMeta: output.Meta(explanationKind), Pod: pod.Namespace + "/" + pod.Name,
		Redirected: p.Decision.Captured(), Reason: p.Decision.Reason, Warnings: p.Warnings, Spec: output.Spec(p.Spec)}
	if p.Spec != nil {
		rs := rules.Build(p.Spec)
		e.Rules = &ruleText{IPv4: ipt.Restore(rs, rules.V4), IPv6: ipt.Restore(rs, rules.V6)}
		if rs.Route != nil {
			e.Rules.PolicyRoute = fmt.Sprintf("ip rule add fwmark %d lookup %d; ip route add local default dev lo table %d", rs.Route.Mark, rs.Route.Table, rs.Route.Table)
		}
	}
	return e
}

func explain(out io.Writer, pod *corev1.Pod, f *explainFlags) error {
	p, err := f.plan(pod)
	if err != nil {
		return err
	}
	if format, _ := output.ParseFormat(f.output); format != output.Text {
		return output.Write(out, format, newExplanation(pod, p))
	}
	printPlan(out, pod, p)
	if p.Spec != nil {
		printRules(out, rules.Build(p.Spec))
	}
	return nil
}

// podPlan is what the plugin does for a pod: its decision and, when it redirects the
// pod, the spec (IP families set) and the findings met deriving it.
type podPlan struct {
	Decision capture.Decision
	Warnings []string
	Spec     *spec.Spec // nil when not redirected
}

// plan runs the plugin's decision (capture.Decide) and spec derivation
// (capture.ForPod) on the pod. IP families come from --pod-ip, else the pod's status
// (podnetns.PodIPs: status.podIPs, else status.podIP).
func (f *explainFlags) plan(pod *corev1.Pod) (podPlan, error) {
	label, err := capture.ParseLabel(f.agentLabel)
	if err != nil {
		return podPlan{}, fmt.Errorf("--agent-pod-label: %w", err)
	}
	mode, err := spec.ParseIPv6Mode("--ipv6-mode", f.ipv6Mode)
	if err != nil {
		return podPlan{}, err
	}
	cfg := capture.Config{ExcludeNamespaces: f.excludeNamespaces, AgentNamespace: f.agentNamespace, AgentLabel: label, IPv6: mode}
	p := podPlan{Decision: capture.Decide(k8spod.From(pod), cfg)}
	if !p.Decision.Captured() {
		return p, nil
	}
	addrs, err := f.addrs(pod)
	if err != nil {
		return p, err
	}
	res, err := cfg.ForPod(k8spod.From(pod), addrs)
	if err != nil {
		return p, fmt.Errorf("the plugin would fail ADD (no rule applied): %w", err)
	}
	p.Warnings, p.Spec = res.Warnings, res.Spec
	return p, nil
}

// addrs are the pod's addresses for the rules' IP families: --pod-ip, else the pod's
// status (podnetns.PodIPs: status.podIPs, else status.podIP).
func (f *explainFlags) addrs(pod *corev1.Pod) ([]netip.Addr, error) {
	if len(f.podIPs) == 0 {
		return podnetns.PodIPs(pod)
	}
	addrs := make([]netip.Addr, 0, len(f.podIPs))
	for _, ip := range f.podIPs {
		a, err := netip.ParseAddr(strings.TrimSpace(ip))
		if err != nil {
			return nil, fmt.Errorf("--pod-ip %q: not an IP address", ip)
		}
		addrs = append(addrs, a)
	}
	return addrs, nil
}

// printPlan writes the pod, the decision, its reason and (when redirected) the spec.
func printPlan(out io.Writer, pod *corev1.Pod, p podPlan) {
	fmt.Fprintf(out, "pod:      %s/%s\n", pod.Namespace, pod.Name)
	if !p.Decision.Captured() {
		fmt.Fprintf(out, "decision: not redirected\nreason:   %s\n", p.Decision.Reason)
		return
	}
	fmt.Fprintf(out, "decision: redirected\nreason:   %s\n", p.Decision.Reason)
	for _, w := range p.Warnings {
		fmt.Fprintf(out, "warning:  %s\n", w)
	}
	if p.Spec != nil {
		printSpec(out, p.Spec)
	}
}

func printSpec(out io.Writer, s *spec.Spec) {
	ports := func(ps []uint16) string {
		if len(ps) == 0 {
			return "-"
		}
		var b []string
		for _, p := range ps {
			b = append(b, fmt.Sprint(p))
		}
		return strings.Join(b, ",")
	}
	set := func(p spec.PortSet) string {
		if p.All {
			return "*"
		}
		return ports(p.Ports)
	}
	prefixes := func(all bool, ps []netip.Prefix) string {
		if all {
			return "*"
		}
		if len(ps) == 0 {
			return "-"
		}
		var b []string
		for _, p := range ps {
			b = append(b, p.String())
		}
		return strings.Join(b, ",")
	}
	fmt.Fprintf(out, "mode:     %s (outbound → %d, inbound → %d, tunnel %d)\n", s.Mode, s.ProxyPort, s.InboundCapturePort, s.InboundTunnelPort)
	fmt.Fprintf(out, "proxy:    uid %v gid %v\n", s.ProxyUIDs, s.ProxyGIDs)
	fmt.Fprintf(out, "inbound:  capture %s, exclude %s\n", set(s.InboundPorts), ports(s.InboundPortsExclude))
	fmt.Fprintf(out, "outbound: capture %s, exclude %s; ports include %s, exclude %s\n",
		prefixes(s.OutboundIPRanges.All, s.OutboundIPRanges.Prefixes), prefixes(false, s.OutboundIPRangesExclude), ports(s.OutboundPorts), ports(s.OutboundPortsExclude))
	fmt.Fprintf(out, "families: ipv4 %v, ipv6 %v (ipv6 mode %s%s); dns capture %v (all %v); drop invalid %v\n",
		s.EnableIPv4, s.IPv6Captured(), s.IPv6, uncapturedIPv6(s), s.RedirectDNS, s.CaptureAllDNS, s.DropInvalid)
	if len(s.ExcludeInterfaces)+len(s.RerouteInterfaces) > 0 {
		fmt.Fprintf(out, "ifaces:   exclude %v, reroute %v\n", s.ExcludeInterfaces, s.RerouteInterfaces)
	}
}

// uncapturedIPv6 says what happens to IPv6 the spec does not capture.
func uncapturedIPv6(s *spec.Spec) string {
	switch {
	case s.IPv6Captured():
		return ""
	case s.IPv6 == spec.IPv6Drop:
		return ": IPv6 dropped but lo, ICMPv6, the proxy's own and established flows"
	}
	return ": IPv6 passes uncaptured"
}
