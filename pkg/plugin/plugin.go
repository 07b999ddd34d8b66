// Package plugin is the meshcni CNI plugin: a chained plugin that, for pods with an
// Istio sidecar, writes the traffic redirect istio-init would write (so workloads need
// no NET_ADMIN), and passes every other pod through untouched. Under Multus it is a
// network of its own and gets no prevResult: it then reads the pod's addresses in the
// pod's netns and returns an empty result, as istio-cni does.
//
// ADD reads the pod from the API server (a plain GET, bounded retries, a total
// deadline) and fails closed: a pod whose redirect cannot be decided or applied is
// not started. DEL removes meshcni's rules when the netns still exists and never fails
// because it is gone. CHECK compares the live rules with the desired ones. STATUS
// reports not-ready until the agent has installed the kubeconfig. GC has nothing to
// collect: the rules live in the pod's netns and die with it.
package plugin

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"strings"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/meshcni/meshcni/pkg/agentsock"
	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/engine"
	"github.com/meshcni/meshcni/pkg/netnsutil"
	"github.com/meshcni/meshcni/pkg/podget"
	"github.com/meshcni/meshcni/pkg/spec"
)

// SupportedVersions are the CNI spec versions the plugin speaks.
var SupportedVersions = version.PluginSupports("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")

// K8sArgs is what the runtime passes in CNI_ARGS for Kubernetes pods.
type K8sArgs struct {
	types.CommonArgs
	K8S_POD_NAMESPACE          types.UnmarshallableString //nolint:revive // CNI_ARGS names
	K8S_POD_NAME               types.UnmarshallableString //nolint:revive
	K8S_POD_INFRA_CONTAINER_ID types.UnmarshallableString //nolint:revive
	K8S_POD_UID                types.UnmarshallableString //nolint:revive
}

// Engine programs a pod's netns (pkg/engine in production; a fake in unit tests).
type Engine interface {
	Apply(ctx context.Context, o engine.Options, s *spec.Spec) (backend.Kind, error)
	Check(ctx context.Context, o engine.Options, s *spec.Spec) (backend.Drift, error)
	Clean(ctx context.Context, o engine.Options) error
}

type realEngine struct{}

func (realEngine) Apply(ctx context.Context, o engine.Options, s *spec.Spec) (backend.Kind, error) {
	return engine.Apply(ctx, o, s)
}
func (realEngine) Check(ctx context.Context, o engine.Options, s *spec.Spec) (backend.Drift, error) {
	return engine.Check(ctx, o, s)
}
func (realEngine) Clean(ctx context.Context, o engine.Options) error { return engine.Clean(ctx, o) }

// Plugin runs CNI commands. The zero value is not usable; use New.
type Plugin struct {
	Engine Engine
	Stdout io.Writer // the CNI result
	Stderr io.Writer // logs when the agent's socket is unreachable
	// NewPodGetter builds the API client from a kubeconfig path (tests replace it).
	NewPodGetter func(kubeconfig string) (PodGetter, error)
	// HelperPath locates the API helper meshcni-podget (STATUS checks it is there).
	HelperPath func() (string, error)
	// PodAddrs lists the addresses in a pod's netns, for calls without a prevResult
	// (tests replace it).
	PodAddrs func(netns string) ([]netip.Addr, error)
}

// PodGetter fetches one pod: in production a podget.Getter, which runs the helper
// meshcni-podget (installed next to the plugin) so that the plugin binary links no
// HTTPS client. Errors are *podget.APIError, *podget.KubeconfigError or
// *podget.HelperError; fetchPod turns each into a CNI error that says what to do.
type PodGetter interface {
	GetPod(ctx context.Context, namespace, name string) (*capture.Pod, error)
	Server() string
}

// New returns the production plugin: pkg/engine, os.Stdout, os.Stderr, the API
// helper next to the plugin.
func New() *Plugin {
	p := &Plugin{
		Engine:     realEngine{},
		Stdout:     os.Stdout,
		Stderr:     os.Stderr,
		HelperPath: podget.HelperPath,
		PodAddrs:   netnsAddrs,
	}
	p.NewPodGetter = func(path string) (PodGetter, error) {
		helper, err := p.HelperPath()
		if err != nil {
			return nil, err
		}
		return &podget.Getter{Helper: helper, Kubeconfig: path}, nil
	}
	return p
}

// Funcs are the plugin's commands for skel.PluginMainFuncs.
func (p *Plugin) Funcs() skel.CNIFuncs {
	return skel.CNIFuncs{Add: p.Add, Del: p.Del, Check: p.Check, Status: p.Status, GC: p.GC}
}

// Main runs the plugin as a CNI binary.
func Main(buildVersion string) {
	skel.PluginMainFuncs(New().Funcs(), SupportedVersions, "meshcni "+buildVersion+": Istio sidecar traffic redirect as a chained CNI plugin")
}

// invocation is one command's parsed input and its logging.
type invocation struct {
	cfg       *Config
	args      *skel.CmdArgs
	namespace string
	name      string
	uid       string
	log       *slog.Logger
	sock      *agentsock.Client
	start     time.Time
	ebpf      *agentsock.PodEBPF // a meshed pod's, reported with a successful ADD
	// decision and reason: what the ADD decided (sandbox.go); the netns cookie, read once.
	decision, reason string
	cookieRead       bool
	netnsCookie      uint64
	cookieErr        error
}

func (p *Plugin) begin(args *skel.CmdArgs, withPrev bool) (*invocation, error) {
	inv := &invocation{args: args, start: time.Now()}
	cfg, err := parseConfig(args.StdinData, withPrev)
	if err != nil {
		return nil, err
	}
	inv.cfg = cfg
	var k K8sArgs
	k.IgnoreUnknown = true
	if err := types.LoadArgs(args.Args, &k); err != nil {
		return nil, types.NewError(types.ErrInvalidEnvironmentVariables, "meshcni: cannot parse CNI_ARGS: "+err.Error(), "")
	}
	inv.namespace, inv.name, inv.uid = string(k.K8S_POD_NAMESPACE), string(k.K8S_POD_NAME), string(k.K8S_POD_UID)

	fallback := slog.NewTextHandler(p.Stderr, &slog.HandlerOptions{Level: cfg.LogLevel})
	var h slog.Handler = fallback
	var untrusted error
	if cfg.AgentRunDir != "" {
		c, err := agentsock.Dial(cfg.AgentRunDir)
		if err == nil {
			inv.sock = c
			h = c.Handler(cfg.LogLevel, fallback)
		} else if errors.Is(err, agentsock.ErrUntrusted) {
			untrusted = err
		}
	}
	inv.log = slog.New(h).With("container_id", shortID(args.ContainerID))
	if inv.namespace != "" || inv.name != "" {
		inv.log = inv.log.With(agentsock.KeyPodNamespace, inv.namespace, agentsock.KeyPodName, inv.name)
	}
	if untrusted != nil {
		inv.log.Warn("not using the agent socket: asking the API server instead", "err", untrusted)
	}
	return inv, nil
}

func (inv *invocation) end(command string, err error) {
	if inv.sock == nil {
		return
	}
	result := agentsock.ResultSuccess
	if err != nil {
		result = agentsock.ResultError
	}
	r := &agentsock.CommandResult{Command: command, Result: result, Seconds: time.Since(inv.start).Seconds(),
		Pod: agentsock.Pod{Namespace: inv.namespace, Name: inv.name}, ContainerID: inv.args.ContainerID}
	if err != nil {
		r.ErrorMsg = err.Error()
	} else {
		r.EBPF = inv.ebpf
		if command == agentsock.CommandAdd {
			r.Sandbox = inv.sandboxReport()
		}
	}
	_ = inv.sock.Report(r)
	_ = inv.sock.Close()
}

func shortID(id string) string {
	if len(id) > 12 {
		return id[:12]
	}
	return id
}

// skipReason says why a call needs neither the API nor any rule: not a Kubernetes
// pod, or an excluded namespace. "" means the pod must be looked at.
func (inv *invocation) skipReason() string {
	if inv.namespace == "" || inv.name == "" {
		return "not a Kubernetes pod (no K8S_POD_NAMESPACE/K8S_POD_NAME in CNI_ARGS)"
	}
	if inv.cfg.CaptureConfig().ExcludedNamespace(inv.namespace) {
		return fmt.Sprintf("namespace %s is excluded", inv.namespace)
	}
	return ""
}

// prevResult returns the chained result, converted to the current version, or nil
// when there is none: meshcni then runs as a network of its own (the agent's
// standalone list, an additional network under Multus), takes the pod's addresses
// from its netns and prints an empty result, as istio-cni does.
func (inv *invocation) prevResult() (*current.Result, error) {
	if inv.cfg.PrevResult == nil {
		inv.log.Debug("no prevResult: a network of its own (as under Multus); the pod's addresses come from its netns")
		return nil, nil
	}
	r, err := current.NewResultFromResult(inv.cfg.PrevResult)
	if err != nil {
		return nil, types.NewError(types.ErrDecodingFailure, "meshcni: cannot convert prevResult: "+err.Error(), "")
	}
	return r, nil
}

// printResult writes the prevResult unchanged, or without one an empty result, in
// the requested version.
func (p *Plugin) printResult(inv *invocation, r *current.Result) error {
	if r == nil {
		r = &current.Result{CNIVersion: current.ImplementedSpecVersion}
	}
	out, err := r.GetAsVersion(inv.cfg.CNIVersion)
	if err != nil {
		return types.NewError(types.ErrIncompatibleCNIVersion, "meshcni: cannot convert the result to version "+inv.cfg.CNIVersion+": "+err.Error(), "")
	}
	if err := out.PrintTo(p.Stdout); err != nil {
		return fmt.Errorf("print result: %w", err)
	}
	return nil
}

// Add is CNI ADD.
func (p *Plugin) Add(args *skel.CmdArgs) (err error) {
	inv, err := p.begin(args, true)
	if err != nil {
		return err
	}
	defer func() { inv.end(agentsock.CommandAdd, err) }()
	prev, err := inv.prevResult()
	if err != nil {
		return err
	}
	if err := p.add(inv, prev); err != nil {
		inv.log.Error("ADD failed", "err", err, "duration", time.Since(inv.start))
		return err
	}
	return p.printResult(inv, prev)
}

func (p *Plugin) add(inv *invocation, prev *current.Result) error {
	if r := inv.skipReason(); r != "" {
		inv.log.Info("pod not meshed", "reason", r)
		if inv.namespace != "" && inv.name != "" {
			inv.decided(agentsock.DecisionSkipped, r)
		}
		return nil
	}
	ctx := context.Background()
	pod, err := p.fetchPod(ctx, inv)
	if err != nil {
		return err
	}
	d := capture.Decide(pod, inv.cfg.CaptureConfig())
	if !d.Captured() {
		inv.log.Info("pod not meshed", "reason", d.Reason)
		inv.decided(agentsock.DecisionSkipped, d.Reason)
		return nil
	}
	inv.decided(agentsock.DecisionMeshed, d.Reason)
	s, accel, err := p.podSpec(inv, pod, prev)
	if err != nil {
		return err
	}
	k, err := p.Engine.Apply(ctx, inv.engineOptions(), s)
	if err != nil {
		return types.NewError(types.ErrInternal, fmt.Sprintf(
			"meshcni cannot apply the traffic redirect of pod %s/%s in %s: %v; meshcni fails closed so the pod is not started unredirected",
			inv.namespace, inv.name, inv.args.Netns, err), "")
	}
	inv.log.Info("pod meshed: redirect applied", "reason", d.Reason, "backend", k, "mode", s.Mode,
		"ipv4", s.EnableIPv4, "ipv6", s.IPv6Captured(), "ipv6Mode", s.IPv6, "duration", time.Since(inv.start))
	inv.ebpf = inv.ebpfReport(accel, s)
	return nil
}

// engineOptions: the configured backend in CNI_NETNS; with the agent connected, the
// engine hands its netlink sockets to the agent to close (a DEL then does not wait
// for the kernel's reclaim of the deleted tables).
func (inv *invocation) engineOptions() engine.Options {
	o := engine.Options{Backend: inv.cfg.Backend, NetnsPath: inv.args.Netns, Logger: inv.log}
	if inv.sock != nil {
		o.HandOff = inv.sock.Release
	}
	return o
}

// podSpec derives the spec and sets its families from the pod's addresses; it also
// returns the pod's eBPF acceleration.
func (p *Plugin) podSpec(inv *invocation, pod *capture.Pod, prev *current.Result) (*spec.Spec, capture.Acceleration, error) {
	res, err := inv.cfg.CaptureConfig().Build(pod)
	if err != nil {
		return nil, "", types.NewError(types.ErrInvalidNetworkConfig, fmt.Sprintf(
			"pod %s/%s: %v; fix the annotation and recreate the pod (no redirect rule was applied)",
			inv.namespace, inv.name, trimPodPrefix(err, pod)), "")
	}
	for _, w := range res.Warnings {
		inv.log.Warn(w)
	}
	addrs, err := p.podAddrs(inv, prev)
	if err != nil {
		return nil, "", err
	}
	capture.WithFamilies(res.Spec, addrs)
	return res.Spec, res.EBPF, nil
}

// podAddrs are the pod's addresses: the prevResult's IPs, else (no prevResult, or
// one without IPs such as the empty result meshcni printed at ADD, which the runtime
// passes back at CHECK) those the pod's netns holds (PodAddrs). Without a
// prevResult, a netns with no address means meshcni runs before the plugin that
// creates the pod's interface: an error.
func (p *Plugin) podAddrs(inv *invocation, prev *current.Result) ([]netip.Addr, error) {
	if prev != nil {
		if addrs := resultAddrs(prev); len(addrs) > 0 {
			return addrs, nil
		}
	}
	const closed = "meshcni fails closed so the pod is not started unredirected"
	addrs, err := p.PodAddrs(inv.args.Netns)
	if err != nil {
		return nil, types.NewError(types.ErrInternal, fmt.Sprintf(
			"meshcni got no IP in a prevResult and cannot read the addresses of pod %s/%s from its netns: %v; %s",
			inv.namespace, inv.name, err, closed), "")
	}
	if len(addrs) == 0 && prev == nil {
		return nil, types.NewError(types.ErrInvalidNetworkConfig, fmt.Sprintf(
			"meshcni got no prevResult and the netns %s of pod %s/%s holds no address: in a chain, list it after the plugin that creates the pod's interface (e.g. bridge or ptp); under Multus, attach it as an additional network (the default network comes first); %s",
			inv.args.Netns, inv.namespace, inv.name, closed), "")
	}
	inv.log.Debug("pod addresses from its netns", "addrs", addrs)
	return addrs, nil
}

func trimPodPrefix(err error, pod *capture.Pod) string {
	return strings.TrimPrefix(err.Error(), fmt.Sprintf("pod %s/%s: ", pod.Namespace, pod.Name))
}

// resultAddrs lists the result's IP addresses (the pod's addresses).
func resultAddrs(r *current.Result) []netip.Addr {
	var out []netip.Addr
	for _, ip := range r.IPs {
		if a, ok := netip.AddrFromSlice(ip.Address.IP); ok {
			out = append(out, a.Unmap())
		}
	}
	return out
}

// Del is CNI DEL: remove meshcni's rules if the netns still exists. It needs no
// API, and a missing netns is success.
func (p *Plugin) Del(args *skel.CmdArgs) (err error) {
	inv, err := p.begin(args, false)
	if err != nil {
		return err
	}
	defer func() { inv.end(agentsock.CommandDel, err) }()
	if r := inv.skipReason(); r != "" {
		inv.log.Debug("DEL: nothing to clean", "reason", r)
		return nil
	}
	if !netnsutil.Exists(args.Netns) {
		inv.log.Debug("DEL: netns gone, its rules with it", "netns", args.Netns)
		return nil
	}
	cerr := p.Engine.Clean(context.Background(), inv.engineOptions())
	if cerr != nil {
		if !netnsutil.Exists(args.Netns) {
			inv.log.Debug("DEL: netns disappeared while cleaning", "netns", args.Netns)
			return nil
		}
		inv.log.Error("DEL failed", "err", cerr)
		return types.NewError(types.ErrInternal, fmt.Sprintf("meshcni cannot remove its rules from %s: %v", args.Netns, cerr), "")
	}
	inv.log.Info("DEL: rules removed", "duration", time.Since(inv.start))
	return nil
}

// Check is CNI CHECK: the live rules must equal the desired ones.
func (p *Plugin) Check(args *skel.CmdArgs) (err error) {
	inv, err := p.begin(args, true)
	if err != nil {
		return err
	}
	defer func() { inv.end(agentsock.CommandCheck, err) }()
	prev, err := inv.prevResult()
	if err != nil {
		return err
	}
	if r := inv.skipReason(); r != "" {
		return nil
	}
	ctx := context.Background()
	pod, err := p.fetchPod(ctx, inv)
	if err != nil {
		return err
	}
	if d := capture.Decide(pod, inv.cfg.CaptureConfig()); !d.Captured() {
		inv.log.Debug("CHECK: pod not meshed, nothing to check", "reason", d.Reason)
		return nil
	}
	s, _, err := p.podSpec(inv, pod, prev)
	if err != nil {
		return err
	}
	drift, err := p.Engine.Check(ctx, inv.engineOptions(), s)
	if err != nil {
		return types.NewError(types.ErrInternal, fmt.Sprintf("meshcni cannot check the rules of pod %s/%s in %s: %v", inv.namespace, inv.name, args.Netns, err), "")
	}
	if !drift.Empty() {
		return types.NewError(types.ErrInternal, fmt.Sprintf("meshcni's redirect of pod %s/%s in %s drifted from the desired rules; recreate the pod", inv.namespace, inv.name, args.Netns), drift.String())
	}
	return nil
}

// Status is CNI STATUS (1.1): ready once the agent has installed the kubeconfig.
func (p *Plugin) Status(args *skel.CmdArgs) error {
	cfg, err := parseConfig(args.StdinData, false)
	if err != nil {
		return err
	}
	if _, err := os.Stat(cfg.Kubeconfig); err != nil {
		return types.NewError(types.ErrPluginNotAvailable, fmt.Sprintf(
			"meshcni is not ready: its kubeconfig %s is missing (%v); meshcni-agent writes it at install, check that it is running on this node", cfg.Kubeconfig, errors.Unwrap(err)), "")
	}
	helper, err := p.HelperPath()
	if err == nil {
		_, err = os.Stat(helper)
	}
	if err != nil {
		return types.NewError(types.ErrPluginNotAvailable, fmt.Sprintf(
			"meshcni is not ready: its API helper %s is missing (%v); meshcni-agent installs it next to the plugin, check that it is running on this node", podget.HelperName, err), "")
	}
	return nil
}

// GC is CNI GC (1.1). meshcni keeps no state outside the pod's netns: its rules die
// with the netns, so there is nothing to collect.
func (p *Plugin) GC(*skel.CmdArgs) error { return nil }
