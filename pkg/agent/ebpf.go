package agent

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/pflag"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/meshcni/meshcni/pkg/agentsock"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/ebpf/sockmap"
)

// EBPFMode says whether the agent loads eBPF acceleration (--ebpf-acceleration).
type EBPFMode string

const (
	// EBPFOff loads nothing: no pod is accelerated, whatever its annotation.
	EBPFOff EBPFMode = "off"
	// EBPFAuto loads the programs when the node can run them (sockmap.Detect) and
	// enables them for the meshed pods that opt in.
	EBPFAuto EBPFMode = "auto"
)

// ebpfFlags defines the eBPF acceleration flags; the returned func parses them.
func (c *Config) ebpfFlags(fs *pflag.FlagSet) func() error {
	var mode, def, namespaces, allowed string
	fs.StringVar(&mode, "ebpf-acceleration", string(EBPFOff), "eBPF acceleration of the app ↔ proxy hop inside meshed pods (docs/ebpf.md): off, or auto (load when the node's kernel can run it; pods opt in by meshcni.io/ebpf-acceleration, --ebpf-default or --ebpf-namespaces)")
	fs.StringVar(&def, "ebpf-default", string(capture.AccelOff), "acceleration of a meshed pod without the meshcni.io/ebpf-acceleration annotation: off, to-proxy (what the app sends to its proxy), both (also what the proxy sends to the app)")
	fs.StringVar(&namespaces, "ebpf-namespaces", "", "comma-separated namespaces whose meshed pods without the annotation get at least to-proxy")
	fs.StringVar(&allowed, "ebpf-allowed-namespaces", "", "comma-separated namespaces outside which no pod is accelerated, whatever its meshcni.io/ebpf-acceleration annotation (the operator's fence; a refused annotation is logged); empty: every namespace")
	fs.StringVar(&c.EBPFForceUnavailable, "ebpf-force-unavailable", "", "make eBPF feature detection fail with this reason, as on a node without the kernel features (tests the fallback)")
	fs.StringVar(&c.EBPFPinDir, "ebpf-pin-dir", sockmap.DefaultPinDir, "bpffs directory of the pinned programs and maps; not on a bpffs, the acceleration is unavailable")
	fs.BoolVar(&c.EBPFMountBPFFS, "ebpf-mount-bpffs", false, "mount a bpffs at "+sockmap.DefaultBPFFS+" when the pin directory is under it and none is mounted, as systemd does at boot: only for an agent running on the host, never in a container (a bpffs mounted there is the container's own and the node does not see the pins)")
	fs.StringVar(&c.EBPFCgroup2, "ebpf-cgroup2", "", "the host's cgroup2 root (in a container: the host's mounted in, as the chart does), which the sockops program attaches to; a cgroup v1 hierarchy with cgroup2 at its unified/ means that unified/; empty: the root of the agent's cgroup2 mount, or one it mounts")
	return func() error {
		switch m := EBPFMode(mode); m {
		case EBPFOff, EBPFAuto:
			c.EBPF = m
		default:
			return fmt.Errorf("--ebpf-acceleration %q: want off or auto", mode)
		}
		a, err := capture.ParseAcceleration("--ebpf-default", def)
		if err != nil {
			return err
		}
		c.EBPFDefault = a
		c.EBPFNamespaces = splitList(namespaces)
		c.EBPFAllowedNamespaces = splitList(allowed)
		return nil
	}
}

// splitList is a comma-separated list's non-empty items, spaces trimmed.
func splitList(s string) []string {
	out := []string{}
	for _, v := range strings.Split(s, ",") {
		if v = strings.TrimSpace(v); v != "" {
			out = append(out, v)
		}
	}
	return out
}

// accelerator is what the agent uses of a loaded *sockmap.Accel.
type accelerator interface {
	Enable(cookie uint64, pod sockmap.Pod) error
	Disable(cookie uint64) error
	Enabled(cookie uint64) (bool, error)
	Stats() (sockmap.Stats, error)
	Close() error
}

// ebpfPod is an accelerated pod sandbox.
type ebpfPod struct {
	namespace, name, uid string
	cookie               uint64
}

// EBPF enables eBPF acceleration for the meshed pods that opt in, from the netns
// cookies the plugin reports with each ADD, and disables it at the sandbox's DEL
// or the pod's deletion. Unavailable (off, or the node cannot run it), pods are
// redirected as without it and the reason is in the log, /readyz and metrics.
type EBPF struct {
	Default    capture.Acceleration
	Namespaces []string
	// Allowed fences acceleration to these namespaces (empty: all), annotations
	// included: the operator's policy wins over a pod's opt-in.
	Allowed []string
	Log     *slog.Logger

	opts   sockmap.Options
	accel  accelerator // nil: unavailable
	reason string      // why accel is nil

	mu   sync.Mutex
	pods map[string]ebpfPod // by sandbox (container) ID
	// state keeps the cookies across the agent's restarts (nil: in memory only).
	state *Sandboxes
}

// newEBPF loads the acceleration as cfg says; a node that cannot run it is not an
// error: the agent runs on without it.
func newEBPF(cfg *Config, log *slog.Logger) *EBPF {
	e := &EBPF{Default: cfg.EBPFDefault, Namespaces: cfg.EBPFNamespaces, Allowed: cfg.EBPFAllowedNamespaces, Log: log,
		opts: sockmap.Options{PinDir: cfg.EBPFPinDir, Cgroup2: cfg.EBPFCgroup2, ForceUnavailable: cfg.EBPFForceUnavailable, MountBPFFS: cfg.EBPFMountBPFFS}, pods: map[string]ebpfPod{}}
	if cfg.EBPF != EBPFAuto {
		e.reason = "off (--ebpf-acceleration off)"
		e.unloadLeftover()
		return e
	}
	a, err := sockmap.Load(e.opts)
	if err != nil {
		e.reason = err.Error()
		log.Warn("eBPF acceleration unavailable: pods are redirected without it", "reason", e.reason)
		return e
	}
	e.accel = a
	log.Info("eBPF acceleration loaded", "pin_dir", e.opts.PinDir, "default", e.Default, "namespaces", e.Namespaces)
	return e
}

// unloadLeftover removes the programs an earlier agent with acceleration on left
// pinned, so that turning it off turns it off.
func (e *EBPF) unloadLeftover() {
	dir := e.opts.PinDir
	if dir == "" {
		dir = sockmap.DefaultPinDir
	}
	if _, err := os.Stat(dir); err != nil {
		return
	}
	if err := sockmap.Unload(e.opts); err != nil {
		e.Log.Warn("eBPF acceleration is off but the programs an earlier agent pinned stay", "pin_dir", dir, "err", err)
		return
	}
	e.Log.Info("eBPF acceleration is off: removed the programs an earlier agent pinned", "pin_dir", dir)
}

// Available reports whether the programs are loaded.
func (e *EBPF) Available() bool { return e != nil && e.accel != nil }

// Detail is the /readyz line about eBPF acceleration.
func (e *EBPF) Detail() string {
	if e.Available() {
		return "ebpf acceleration: loaded"
	}
	return "ebpf acceleration: unavailable: " + e.reason
}

// Mode is the acceleration of a pod in namespace ns whose annotation is a (parsed
// by the plugin; "" without one): off outside Allowed (when set), else the
// annotation, else at least to-proxy in Namespaces, else Default.
func (e *EBPF) Mode(ns string, a capture.Acceleration) capture.Acceleration {
	if len(e.Allowed) > 0 && !slices.Contains(e.Allowed, ns) {
		return capture.AccelOff
	}
	if a != capture.AccelDefault {
		return a
	}
	if slices.Contains(e.Namespaces, ns) && !e.Default.On() {
		return capture.AccelToProxy
	}
	return e.Default
}

// OnCommand acts on one CNI command result of the plugin: a successful ADD with
// eBPF details enables the pod's netns when its mode is on; a DEL disables what
// the sandbox's ADD enabled.
func (e *EBPF) OnCommand(r *agentsock.CommandResult) {
	if !e.Available() || r.ContainerID == "" {
		return
	}
	switch {
	case r.Command == agentsock.CommandAdd && r.Result == agentsock.ResultSuccess && r.EBPF != nil:
		e.enable(r)
	case r.Command == agentsock.CommandDel:
		e.disable(r.ContainerID)
	}
}

func (e *EBPF) enable(r *agentsock.CommandResult) {
	log := e.Log.With("pod_namespace", r.Pod.Namespace, "pod_name", r.Pod.Name, "netns_cookie", r.EBPF.NetnsCookie)
	a, err := capture.ParseAcceleration("the plugin's eBPF mode", r.EBPF.Mode)
	if r.EBPF.Mode == "" {
		a, err = capture.AccelDefault, nil
	}
	if err != nil {
		log.Warn("eBPF acceleration not enabled", "err", err)
		return
	}
	mode := e.Mode(r.Pod.Namespace, a)
	if !mode.On() {
		if a.On() {
			log.Warn("eBPF acceleration refused: the pod's annotation opts in outside --ebpf-allowed-namespaces", "annotation", a, "allowed_namespaces", e.Allowed)
		}
		return
	}
	if err := e.accel.Enable(r.EBPF.NetnsCookie, sockmap.Pod{ProxyUID: r.EBPF.ProxyUID, ToApp: mode == capture.AccelBoth}); err != nil {
		log.Error("eBPF acceleration not enabled: the pod runs without it", "err", err)
		return
	}
	p := ebpfPod{namespace: r.Pod.Namespace, name: r.Pod.Name, uid: r.EBPF.PodUID, cookie: r.EBPF.NetnsCookie}
	e.mu.Lock()
	e.pods[r.ContainerID] = p
	e.mu.Unlock()
	e.state.enabled(r.ContainerID, p, mode)
	log.Info("eBPF acceleration enabled", "mode", mode)
}

// disable removes a sandbox's netns from the allow-list.
func (e *EBPF) disable(containerID string) {
	e.mu.Lock()
	p, ok := e.pods[containerID]
	delete(e.pods, containerID)
	e.mu.Unlock()
	if !ok {
		return
	}
	if err := e.accel.Disable(p.cookie); err != nil {
		e.Log.Error("eBPF acceleration", "pod_namespace", p.namespace, "pod_name", p.name, "err", err)
		return
	}
	e.Log.Info("eBPF acceleration disabled", "pod_namespace", p.namespace, "pod_name", p.name, "netns_cookie", p.cookie)
}

// PodDeleted disables the sandboxes of a deleted pod (a missed DEL). With uid
// set, only that pod's: a newer pod of the same name keeps its own.
func (e *EBPF) PodDeleted(namespace, name, uid string) {
	e.mu.Lock()
	var ids []string
	for id, p := range e.pods {
		if p.namespace == namespace && p.name == name && (uid == "" || p.uid == "" || p.uid == uid) {
			ids = append(ids, id)
		}
	}
	e.mu.Unlock()
	for _, id := range ids {
		e.disable(id)
	}
}

// PodAccelerated reports whether a pod's sandbox netns is on the allow-list
// (false while unavailable).
func (e *EBPF) PodAccelerated(namespace, name string) (bool, error) {
	if !e.Available() {
		return false, nil
	}
	e.mu.Lock()
	var cookies []uint64
	for _, p := range e.pods {
		if p.namespace == namespace && p.name == name {
			cookies = append(cookies, p.cookie)
		}
	}
	e.mu.Unlock()
	for _, c := range cookies {
		if ok, err := e.accel.Enabled(c); ok || err != nil {
			return ok, err
		}
	}
	return false, nil
}

// Answer answers the agent socket's RequestEBPF from the allow-list itself (which
// outlives an agent restart).
func (e *EBPF) Answer(req agentsock.EBPFRequest) (*agentsock.EBPFResponse, error) {
	if !e.Available() {
		r := &agentsock.EBPFResponse{Reason: "off"}
		if e != nil {
			r.Reason = e.reason
		}
		return r, nil
	}
	ok, err := e.accel.Enabled(req.NetnsCookie)
	if err != nil {
		return nil, err
	}
	return &agentsock.EBPFResponse{Available: true, Accelerated: ok}, nil
}

// watchDeletions disables a pod's acceleration when the pod leaves the node's cache.
func (e *EBPF) watchDeletions(inf cache.SharedIndexInformer) error {
	_, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{DeleteFunc: func(obj any) {
		if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
			obj = d.Obj
		}
		if p, ok := obj.(*corev1.Pod); ok {
			e.PodDeleted(p.Namespace, p.Name, string(p.UID))
		}
	}})
	if err != nil {
		return fmt.Errorf("eBPF acceleration: watch pod deletions: %w", err)
	}
	return nil
}

// exit releases the programs: kept (their pins stay, the next agent re-opens them
// and pods stay accelerated) or removed with the plugin.
func (e *EBPF) exit(remove bool, log *slog.Logger) error {
	var errs []error
	if e.accel != nil {
		errs = append(errs, e.accel.Close())
	}
	if remove && e.accel != nil {
		errs = append(errs, sockmap.Unload(e.opts))
		log.Info("removed eBPF acceleration (programs, maps, pins)", "pin_dir", e.opts.PinDir)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("eBPF acceleration: %w", err)
	}
	return nil
}

// eBPF metrics.
var (
	descEBPFAvailable = prometheus.NewDesc("meshcni_ebpf_available", "1 when eBPF acceleration is loaded on this node; 0 when off or unavailable (the log and /readyz say why).", nil, nil)
	descEBPFPods      = prometheus.NewDesc("meshcni_ebpf_accelerated_pods", "Pod sandboxes whose network namespace the agent enabled.", nil, nil)
	descEBPFSockets   = prometheus.NewDesc("meshcni_ebpf_accelerated_sockets", "Open sockets in the sockhash (accelerated connections' ends).", nil, nil)
	descEBPFRecorded  = prometheus.NewDesc("meshcni_ebpf_sockets_recorded_total", "Sockets recorded since the programs were loaded.", nil, nil)
	descEBPFCollide   = prometheus.NewDesc("meshcni_ebpf_socket_collisions_total", "Sockets not recorded because their key was taken.", nil, nil)
	descEBPFMessages  = prometheus.NewDesc("meshcni_ebpf_redirected_messages_total", "Messages handed straight to the peer socket.", nil, nil)
	descEBPFBytes     = prometheus.NewDesc("meshcni_ebpf_redirected_bytes_total", "Bytes handed straight to the peer socket.", nil, nil)
	descEBPFMisses    = prometheus.NewDesc("meshcni_ebpf_map_misses_total", "Messages whose peer socket was not in the map (sent through TCP).", nil, nil)
)

// Describe implements prometheus.Collector.
func (e *EBPF) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descEBPFAvailable, descEBPFPods, descEBPFSockets, descEBPFRecorded, descEBPFCollide, descEBPFMessages, descEBPFBytes, descEBPFMisses} {
		ch <- d
	}
}

// Collect implements prometheus.Collector: the counters are read at each scrape.
func (e *EBPF) Collect(ch chan<- prometheus.Metric) {
	if !e.Available() {
		ch <- prometheus.MustNewConstMetric(descEBPFAvailable, prometheus.GaugeValue, 0)
		return
	}
	ch <- prometheus.MustNewConstMetric(descEBPFAvailable, prometheus.GaugeValue, 1)
	e.mu.Lock()
	n := len(e.pods)
	e.mu.Unlock()
	ch <- prometheus.MustNewConstMetric(descEBPFPods, prometheus.GaugeValue, float64(n))
	s, err := e.accel.Stats()
	if err != nil {
		e.Log.Warn("eBPF acceleration: read stats", "err", err)
		return
	}
	ch <- prometheus.MustNewConstMetric(descEBPFSockets, prometheus.GaugeValue, float64(s.Sockets))
	for _, c := range []struct {
		d *prometheus.Desc
		v uint64
	}{{descEBPFRecorded, s.Recorded}, {descEBPFCollide, s.Collisions}, {descEBPFMessages, s.Messages}, {descEBPFBytes, s.Bytes}, {descEBPFMisses, s.Misses}} {
		ch <- prometheus.MustNewConstMetric(c.d, prometheus.CounterValue, float64(c.v))
	}
}
