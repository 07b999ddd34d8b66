package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/engine"
	"github.com/meshcni/meshcni/pkg/meshcnictl/kubeget"
	"github.com/meshcni/meshcni/pkg/meshcnictl/output"
	"github.com/meshcni/meshcni/pkg/podnetns"
	"github.com/meshcni/meshcni/pkg/spec"
)

func init() { subcommands = append(subcommands, newInspectCmd) }

// Exit codes of inspect.
const (
	exitDrift = 1 // live rules differ from the desired ones, or rules on an un-meshed pod
	exitUsage = 2 // bad flags or arguments, pod or netns not found, API or netlink failure
)

// Results of inspect (the "status" field of -o json).
const (
	statusInSync          = "in-sync"          // meshed, live rules equal the desired ones
	statusDrift           = "drift"            // meshed, live rules differ
	statusNotMeshed       = "not-meshed"       // not meshed and no meshcni rule
	statusUnexpectedRules = "unexpected-rules" // not meshed but meshcni rules are present
	statusLiveOnly        = "live-only"        // a netns without a pod: nothing to compare with
)

type inspectFlags struct {
	explainFlags // kubeconfig, namespace, exclude-namespaces, agent-pod-label, timeout
	netns        string
	netnsDirs    []string
	nodeName     string
	backend      string
	cniConfDir   string
	agentRunDir  string
	// pluginFlags: --exclude-namespaces or --agent-pod-label given, which then win
	// over the node's meshcni entry.
	pluginFlags bool
}

func newInspectCmd() *cobra.Command {
	f := &inspectFlags{}
	cmd := &cobra.Command{
		Use:   "inspect POD|NETNS",
		Short: "Show a pod's live meshcni rules on this node and whether they are the ones its annotations ask for",
		Long: `inspect reads the live meshcni rules in a pod's network namespace on this node,
whichever backend holds them (nftables, iptables-nft, iptables-legacy), and compares
them with the rules the CNI plugin writes for the pod (as explain shows them). Run it
as root on the pod's node; it changes nothing.

POD is [NAMESPACE/]NAME (or -n NAMESPACE NAME; the namespace defaults to the
kubeconfig context's), read from the API server (--kubeconfig, default $KUBECONFIG,
then the in-cluster service account). Its network namespace is found on this node
from the pod's IPs, in the --netns-dir directories and in /proc; when several
namespaces hold them (a stale one, an address in use twice) inspect names them and
refuses to choose. --netns PATH skips the search.

NETNS is a path to a network namespace file (absolute, or starting with ./ or ../),
e.g. /var/run/netns/cni-1234 or /proc/PID/ns/net: its live rules are printed, with
nothing to compare them with.

It also asks meshcni's agent on this node, over its socket in --agent-run-dir
(default: the cni_agent_run_dir of the node's meshcni entry, else /var/run/meshcni),
whether the namespace is eBPF-accelerated (docs/ebpf.md): "accelerated", "not
accelerated", or "unknown: <why>" when the agent cannot be asked.

-o json or -o yaml prints a PodRedirectInspection (apiVersion meshcni.io/v1alpha1).

Exit status: 0 when the rules are as desired (a meshed pod in sync, an un-meshed pod
without meshcni rules, or a NETNS given alone); 1 on drift or meshcni rules on a pod
that is not meshed; 2 on usage errors and when the pod or its netns cannot be found.`,
		Args: func(cmd *cobra.Command, args []string) error {
			if err := cobra.MaximumNArgs(1)(cmd, args); err != nil {
				return &exitError{code: exitUsage, err: err}
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx, cancel := context.WithTimeout(cmd.Context(), f.timeout)
			defer cancel()
			f.pluginFlags = cmd.Flags().Changed("exclude-namespaces") || cmd.Flags().Changed("agent-pod-label") || cmd.Flags().Changed("ipv6-mode")
			return runInspect(ctx, cmd.OutOrStdout(), f, args)
		},
	}
	cmd.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return &exitError{code: exitUsage, err: err} })
	fl := cmd.Flags()
	f.explainFlags.registerPodFlags(fl)
	fl.StringVar(&f.netns, "netns", "", "network namespace path of the pod (skips the search)")
	fl.StringArrayVar(&f.netnsDirs, "netns-dir", podnetns.DefaultNetnsDirs, "directory of the runtime's bind-mounted netns files to search (repeatable; replaces the defaults)")
	fl.StringVar(&f.nodeName, "node-name", defaultNodeName(), "this node's name, to tell when the pod runs elsewhere (from $NODE_NAME, else the host name)")
	fl.StringVar(&f.backend, "backend", "auto", "backend whose rules to read: auto (whichever holds rules), nftables, iptables-nft or iptables-legacy")
	fl.StringVarP(&f.output, "output", "o", "text", "output format: text, json or yaml")
	fl.StringVar(&f.cniConfDir, "cni-conf-dir", "/etc/cni/net.d", "the node's CNI configuration directory: the plugin's exclude_namespaces, agent_pod_namespace and agent_pod_label are read from meshcni's entry there, unless given as flags")
	fl.StringVar(&f.agentRunDir, "agent-run-dir", "", "directory of meshcni agent's socket, asked whether the pod is eBPF-accelerated (default: the cni_agent_run_dir of the node's meshcni entry, else "+defaultAgentRunDir+")")
	return cmd
}

// registerPodFlags registers the flags inspect shares with explain.
func (f *explainFlags) registerPodFlags(fl *pflag.FlagSet) {
	fl.StringVar(&f.kubeconfig, "kubeconfig", os.Getenv("KUBECONFIG"), "kubeconfig to read the pod with (default $KUBECONFIG, else the in-cluster service account)")
	fl.StringVarP(&f.namespace, "namespace", "n", "", "namespace of POD (default: the kubeconfig context's namespace)")
	fl.StringSliceVar(&f.excludeNamespaces, "exclude-namespaces", nil, "namespaces whose pods the plugin never redirects (its exclude_namespaces)")
	fl.StringVar(&f.agentNamespace, "agent-pod-namespace", "", "namespace of meshcni's agent, whose pods carrying --agent-pod-label are never redirected (the plugin's agent_pod_namespace; empty: none is exempt by label)")
	fl.StringVar(&f.agentLabel, "agent-pod-label", capture.DefaultAgentLabel, "label KEY=VALUE of the agent's pods (the plugin's agent_pod_label)")
	fl.StringVar(&f.ipv6Mode, "ipv6-mode", string(spec.IPv6Istio), "IPv6 of meshed pods (the plugin's ipv6 key): istio, capture or drop; a pod's meshcni.io/ipv6 annotation wins")
	fl.DurationVar(&f.timeout, "timeout", 20*time.Second, "give up after this long")
}

func defaultNodeName() string {
	if n := os.Getenv("NODE_NAME"); n != "" {
		return n
	}
	h, _ := os.Hostname()
	return strings.ToLower(h)
}

// inspectKind is the kind of inspect's -o json|yaml result.
const inspectKind = "PodRedirectInspection"

// inspectReport is inspect's result; -o json|yaml prints it as is.
type inspectReport struct {
	output.TypeMeta `json:",inline"`
	Pod             string               `json:"pod,omitempty"` // namespace/name
	Node            string               `json:"node,omitempty"`
	Meshed          *bool                `json:"meshed,omitempty"`
	Reason          string               `json:"reason,omitempty"`
	Warnings        []string             `json:"warnings,omitempty"`
	Spec            *output.RedirectSpec `json:"spec,omitempty"`
	// PluginConfig is the node's file whose meshcni entry the decision used ("" when
	// the flags were given or no entry was found).
	PluginConfig string                  `json:"pluginConfig,omitempty"`
	Netns        string                  `json:"netns"`
	Live         map[backend.Kind]string `json:"live"`            // backend → its live meshcni rules
	Drift        *driftReport            `json:"drift,omitempty"` // meshed pods only
	Status       string                  `json:"status"`
	Problems     []string                `json:"problems,omitempty"`
	// EBPF is "accelerated", "not accelerated" or "unknown: <why>" (the agent could
	// not be asked); EBPFReason says why a pod is not accelerated.
	EBPF       string `json:"ebpf"`
	EBPFReason string `json:"ebpfReason,omitempty"`

	plan *podPlan
	pod  *corev1.Pod
	spec *spec.Spec // the desired redirect (nil: not meshed, or no pod)
}

// driftReport is backend.Drift for -o json: rules in the backend's text form, each
// naming its table and chain.
type driftReport struct {
	Missing    []string `json:"missing"`
	Unexpected []string `json:"unexpected"`
}

func usageErr(format string, args ...any) error {
	return &exitError{code: exitUsage, err: fmt.Errorf(format, args...)}
}

func runInspect(ctx context.Context, out io.Writer, f *inspectFlags, args []string) error {
	format, err := output.ParseFormat(f.output)
	if err != nil {
		return &exitError{code: exitUsage, err: err}
	}
	kind, err := backend.ParseKind(f.backend)
	if err != nil {
		return usageErr("--backend: %w", err)
	}
	var ref string
	if len(args) == 1 {
		if isPath(args[0]) {
			if f.netns != "" {
				return usageErr("give the netns either as the argument or with --netns, not both")
			}
			f.netns = args[0]
		} else {
			ref = args[0]
		}
	}
	if ref == "" && f.netns == "" {
		return usageErr("give a pod ([NAMESPACE/]NAME) or a network namespace path")
	}
	if f.netns != "" {
		if err := checkNetnsPath(f.netns); err != nil {
			return &exitError{code: exitUsage, err: err}
		}
	}

	r := &inspectReport{TypeMeta: output.Meta(inspectKind), Netns: f.netns}
	runDir := f.agentRunDir
	// enter is the path the rules are read through: the one given, else the found
	// namespace's open handle (r.Netns names it).
	enter := f.netns
	if ref != "" {
		ns, name, err := f.podRef(ref)
		if err != nil {
			return &exitError{code: exitUsage, err: err}
		}
		pod, err := getPod(ctx, f.kubeconfig, ns, name)
		if err != nil {
			return &exitError{code: exitUsage, err: err}
		}
		if !f.pluginFlags {
			cfg, file, err := nodePluginConfig(f.cniConfDir)
			switch {
			case err == nil:
				f.excludeNamespaces, f.agentNamespace, f.agentLabel, r.PluginConfig = cfg.ExcludeNamespaces, cfg.AgentNamespace, cfg.AgentLabel.String(), file
				f.ipv6Mode = string(cfg.IPv6)
				if runDir == "" {
					runDir = cfg.AgentRunDir
				}
			case errors.Is(err, errNoEntry), errors.Is(err, fs.ErrNotExist):
				// Not installed here (or another conf dir): the flags' defaults decide.
			default:
				return &exitError{code: exitUsage, err: err}
			}
		}
		p, err := f.plan(pod)
		if err != nil {
			return &exitError{code: exitUsage, err: fmt.Errorf("pod %s/%s: %w", ns, name, err)}
		}
		meshed := p.Decision.Captured()
		r.pod, r.plan = pod, &p
		r.Pod, r.Node, r.Meshed, r.Reason, r.Warnings, r.spec = ns+"/"+name, pod.Spec.NodeName, &meshed, p.Decision.Reason, p.Warnings, p.Spec
		r.Spec = output.Spec(p.Spec)
		if r.Netns == "" {
			h, err := f.findNetns(ctx, pod)
			if err != nil {
				return &exitError{code: exitUsage, err: err}
			}
			defer h.Close()
			r.Netns, enter = h.Path, h.NetnsPath()
		}
	}

	o := engine.Options{Backend: kind, NetnsPath: enter}
	live, err := engine.Live(ctx, o)
	if err != nil {
		return &exitError{code: exitUsage, err: fmt.Errorf("read the live rules in %s: %w", r.Netns, err)}
	}
	r.Live = map[backend.Kind]string{}
	for k, txt := range live {
		if strings.TrimSpace(txt) != "" {
			r.Live[k] = txt
		}
	}
	if runDir == "" {
		runDir = defaultAgentRunDir
	}
	r.inspectEBPF(ctx, enter, runDir)
	holders := sortedKinds(r.Live)
	switch {
	case r.plan == nil:
		r.Status = statusLiveOnly
	case r.spec == nil: // not meshed
		r.Status = statusNotMeshed
		if len(holders) > 0 {
			r.Status = statusUnexpectedRules
			r.Problems = append(r.Problems, fmt.Sprintf("the pod is not meshed but %s holds meshcni rules", joinKinds(holders)))
		}
	default:
		d, err := engine.Check(ctx, o, r.spec)
		if err != nil {
			return &exitError{code: exitUsage, err: fmt.Errorf("check the rules in %s: %w", r.Netns, err)}
		}
		r.Drift = &driftReport{Missing: append([]string{}, d.Missing...), Unexpected: append([]string{}, d.Unexpected...)}
		r.Status = statusInSync
		if !d.Empty() {
			r.Status = statusDrift
			r.Problems = append(r.Problems, fmt.Sprintf("%d missing, %d unexpected rule(s)", len(d.Missing), len(d.Unexpected)))
		}
		if len(holders) > 1 && kind == backend.Auto {
			r.Status = statusDrift
			r.Problems = append(r.Problems, fmt.Sprintf("meshcni rules in several backends (%s); compared with %s only", joinKinds(holders), holders[0]))
		}
	}

	if format != output.Text {
		if err := output.Write(out, format, r); err != nil {
			return err
		}
	} else {
		printInspect(out, r)
	}
	switch r.Status {
	case statusDrift:
		return &exitError{code: exitDrift, err: fmt.Errorf("%s: live rules drift from the desired ones: %s", r.subject(), strings.Join(r.Problems, "; "))}
	case statusUnexpectedRules:
		return &exitError{code: exitDrift, err: fmt.Errorf("%s: %s", r.subject(), strings.Join(r.Problems, "; "))}
	}
	return nil
}

func (r *inspectReport) subject() string {
	if r.Pod != "" {
		return "pod " + r.Pod
	}
	return "netns " + r.Netns
}

func printInspect(out io.Writer, r *inspectReport) {
	if r.plan != nil {
		printPlan(out, r.pod, *r.plan)
		if r.PluginConfig != "" {
			fmt.Fprintf(out, "config:   meshcni entry of %s\n", r.PluginConfig)
		}
		fmt.Fprintf(out, "node:     %s\n", r.Node)
	}
	fmt.Fprintf(out, "netns:    %s\n", r.Netns)
	holders := sortedKinds(r.Live)
	if len(holders) == 0 {
		fmt.Fprintln(out, "live:     no meshcni rules")
	}
	for _, k := range holders {
		fmt.Fprintf(out, "live:     %s\n", k)
		for _, line := range strings.Split(strings.TrimRight(r.Live[k], "\n"), "\n") {
			fmt.Fprintf(out, "  %s\n", line)
		}
	}
	if r.Drift != nil {
		d := backend.Drift{Missing: r.Drift.Missing, Unexpected: r.Drift.Unexpected}
		if d.Empty() {
			fmt.Fprintln(out, "drift:    none")
		} else {
			fmt.Fprintln(out, "drift:")
			for _, line := range strings.Split(d.String(), "\n") {
				fmt.Fprintf(out, "  %s\n", line)
			}
		}
	}
	if r.EBPFReason != "" {
		fmt.Fprintf(out, "ebpf:     %s; %s\n", r.EBPF, r.EBPFReason)
	} else {
		fmt.Fprintf(out, "ebpf:     %s\n", r.EBPF)
	}
	msg := map[string]string{
		statusInSync:          "in sync: the live rules are the ones the pod's annotations ask for",
		statusDrift:           "DRIFT: " + strings.Join(r.Problems, "; "),
		statusNotMeshed:       "not meshed, and no meshcni rule in its netns",
		statusUnexpectedRules: "UNEXPECTED RULES: " + strings.Join(r.Problems, "; "),
		statusLiveOnly:        "live rules only (no pod given: nothing to compare with)",
	}[r.Status]
	fmt.Fprintf(out, "result:   %s\n", msg)
}

func sortedKinds(m map[backend.Kind]string) []backend.Kind {
	ks := make([]backend.Kind, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	// Select's preference order: nftables, iptables-nft, iptables-legacy.
	rank := map[backend.Kind]int{backend.Nftables: 0, backend.IptablesNft: 1, backend.IptablesLegacy: 2}
	sort.Slice(ks, func(i, j int) bool { return rank[ks[i]] < rank[ks[j]] })
	return ks
}

func joinKinds(ks []backend.Kind) string {
	s := make([]string, len(ks))
	for i, k := range ks {
		s[i] = string(k)
	}
	return strings.Join(s, ", ")
}

// isPath tells a netns path argument from a pod reference: a pod name never starts
// with / or a dot.
func isPath(arg string) bool {
	return strings.HasPrefix(arg, "/") || strings.HasPrefix(arg, "./") || strings.HasPrefix(arg, "../")
}

func checkNetnsPath(p string) error {
	if _, err := os.Stat(p); err != nil {
		return fmt.Errorf("netns %s: %w", p, err)
	}
	return nil
}

// findNetns finds the pod's netns on this node and holds it open, or says why not
// (another node, no IP yet, the host network, several namespaces holding its IPs).
func (f *inspectFlags) findNetns(ctx context.Context, pod *corev1.Pod) (*podnetns.Handle, error) {
	finder := &podnetns.Finder{NetnsDirs: f.netnsDirs}
	h, err := finder.FindPod(ctx, pod)
	if err == nil {
		return h, nil
	}
	id := pod.Namespace + "/" + pod.Name
	switch {
	case errors.Is(err, podnetns.ErrHostNetwork):
		return nil, fmt.Errorf("pod %s uses the host network: no netns of its own, meshcni does not redirect it", id)
	case pod.Spec.NodeName == "" && (errors.Is(err, podnetns.ErrNoPodIP) || errors.Is(err, podnetns.ErrNotFound)):
		return nil, fmt.Errorf("pod %s is not scheduled to a node yet", id)
	case pod.Spec.NodeName != f.nodeName && (errors.Is(err, podnetns.ErrNoPodIP) || errors.Is(err, podnetns.ErrNotFound)):
		return nil, fmt.Errorf("pod %s runs on node %s, this is node %s (--node-name): run inspect on %s", id, pod.Spec.NodeName, f.nodeName, pod.Spec.NodeName)
	case errors.Is(err, podnetns.ErrNotFound):
		return nil, fmt.Errorf("%w (give the runtime's netns directory with --netns-dir, or --netns)", err)
	case errors.Is(err, podnetns.ErrAmbiguous):
		return nil, fmt.Errorf("%w (give the pod's netns with --netns)", err)
	}
	return nil, err
}

// podRef parses [NAMESPACE/]NAME; the namespace defaults to ns (-n).
func podRef(ref, ns string) (string, string, error) {
	name := ref
	if a, b, ok := strings.Cut(ref, "/"); ok {
		ns, name = a, b
	}
	for _, v := range []struct{ what, val string }{{"namespace", ns}, {"pod name", name}} {
		if errs := validation.IsDNS1123Subdomain(v.val); len(errs) > 0 {
			return "", "", fmt.Errorf("%s %q in %q: %s", v.what, v.val, ref, strings.Join(errs, "; "))
		}
	}
	return ns, name, nil
}

// getPod GETs the pod with the kubeconfig (any kubectl credential), or with none
// given, the in-cluster service account. A missing pod fails at once.
func getPod(ctx context.Context, kubeconfig, ns, name string) (*corev1.Pod, error) {
	c, err := kubeget.New(kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("get pod %s/%s: %w", ns, name, err)
	}
	var pod corev1.Pod
	if err := c.Get(ctx, "api/v1/namespaces/"+ns+"/pods/"+name, nil, &pod); err != nil {
		var se *kubeget.StatusError
		if errors.As(err, &se) {
			return nil, fmt.Errorf("get pod %s/%s from %s: %s: %s", ns, name, c.Host(), se.Status, se.Message)
		}
		return nil, fmt.Errorf("get pod %s/%s from %s: %w", ns, name, c.Host(), err)
	}
	return &pod, nil
}
