// Package agent is meshcni's node agent: it installs the CNI plugin (binary, kubeconfig,
// configuration entry), guards it against other writers, serves health and metrics,
// and receives the plugin's logs and command results on a unix socket.
//
// The agent is a set of Runnables run together: the guard, the health server and the
// socket server. Later parts (a repair controller, an informer of the node's pods) are
// more Runnables added with Add.
package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"

	"k8s.io/client-go/kubernetes"

	"github.com/meshcni/meshcni/pkg/agent/nodepods"
	"github.com/meshcni/meshcni/pkg/agentsock"
	"github.com/meshcni/meshcni/pkg/buildinfo"
	"github.com/meshcni/meshcni/pkg/buildinfo/buildmetrics"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/heal"
	"github.com/meshcni/meshcni/pkg/install"
	"github.com/meshcni/meshcni/pkg/podget"
)

// Runnable is one long-running part of the agent. Run blocks until ctx ends (nil) or
// the part fails (an error, which stops the agent).
type Runnable interface {
	Name() string
	Run(ctx context.Context) error
}

// Agent runs the node agent's parts.
type Agent struct {
	Config  *Config
	Log     *slog.Logger
	Metrics *Metrics
	Guard   *Guard
	Health  *HealthServer
	Socket  *SocketServer
	// Pods caches the node's pods when the agent has API access and knows its node
	// (nil otherwise); parts that need them add handlers before Run.
	Pods *nodepods.Cache
	// PluginToken mints and renews the plugin's token (nil: the plugin's kubeconfig
	// comes from --kubeconfig-source or the agent's own token).
	PluginToken *PluginToken
	// EBPF is the eBPF acceleration of meshed pods (off or unavailable: inert).
	EBPF *EBPF
	// Sandboxes is the per-sandbox state that outlives the agent's restarts.
	Sandboxes *Sandboxes

	kube      *Kube // nil: no API access
	runnables []Runnable
	evictor   *heal.Evictor // the audit's and the repair's one eviction path (repair.go)
}

// Options are the agent's injectable collaborators.
type Options struct {
	// Recorder reports conflicts as Kubernetes Events; nil reports to the log only.
	Recorder Recorder
	// Kube is the agent's own API access; nil runs without it (no Events, no pod
	// informer, no repair).
	Kube *Kube
	// Getenv reads the environment (default os.Getenv): the in-cluster API address.
	Getenv func(string) string
	// Version is the agent binary's version (GET /version, meshcni_build_info).
	Version string
}

// New builds the agent from a validated configuration.
func New(cfg *Config, log *slog.Logger, opts Options) (*Agent, error) {
	if opts.Getenv == nil {
		opts.Getenv = os.Getenv
	}
	m := NewMetrics()
	build := buildinfo.New(opts.Version)
	m.Registry.MustRegister(buildmetrics.Collector(build))
	a := &Agent{Config: cfg, Log: log, Metrics: m, kube: opts.Kube}
	src, err := a.pluginCredential(opts)
	if err != nil {
		return nil, err
	}
	a.Guard = &Guard{
		Conf: install.ConflistOptions{
			Dir:            cfg.CNIConfDir,
			FileName:       cfg.CNIConfFileName,
			Chained:        cfg.Chained,
			StandaloneFile: cfg.StandaloneFileName,
			NetworkName:    cfg.NetworkName,
			Entry:          cfg.Entry(),
		},
		Binary:            &install.Binary{Src: cfg.PluginBinary, Dst: cfg.PluginPath(), Companions: []string{podget.HelperName}},
		Kubeconfig:        &install.Kubeconfig{Source: src, Path: cfg.KubeconfigPath()},
		Debounce:          cfg.Debounce,
		Resync:            cfg.Resync,
		ConflictThreshold: cfg.ConflictThreshold,
		ConflictWindow:    cfg.ConflictWindow,
		BackoffMax:        cfg.BackoffMax,
		Log:               log.With("component", "guard"),
		Metrics:           m,
		Recorder:          opts.Recorder,
	}
	a.Health = &HealthServer{Addr: cfg.HealthAddr, Ready: a.Guard.Ready, Metrics: m, Log: log, Build: build}
	a.Socket = &SocketServer{Path: agentsock.Path(cfg.RunDir), Log: log, Metrics: m}
	a.runnables = []Runnable{a.Socket, a.Health, a.Guard}
	a.EBPF = newEBPF(cfg, log.With("component", "ebpf"))
	m.Registry.MustRegister(a.EBPF)
	a.Socket.EBPF = a.EBPF
	mesh := capture.Config{ExcludeNamespaces: cfg.ExcludeNamespaces, AgentNamespace: cfg.PodNamespace, IPv6: cfg.IPv6}
	a.Sandboxes = &Sandboxes{Dir: sandboxDir(cfg.RunDir), Mesh: mesh, Log: log.With("component", "sandbox-state")}
	a.EBPF.state = a.Sandboxes
	a.Socket.Sandboxes = a.Sandboxes
	a.Health.Detail = a.EBPF.Detail
	if a.PluginToken != nil {
		a.PluginToken.Changed = a.Guard.KubeconfigChanged
		a.runnables = append(a.runnables, a.PluginToken)
	}
	if opts.Kube != nil && cfg.NodeName != "" {
		pods, err := nodepods.New(opts.Kube.Client, cfg.NodeName, 0)
		if err != nil {
			return nil, err
		}
		pods.Log = log.With("component", "node-pods")
		a.Pods = pods
		a.Socket.Pods = pods
		if err := a.EBPF.watchDeletions(pods.Informer()); err != nil {
			return nil, err
		}
		a.Sandboxes.Pods = pods
		if err := a.Sandboxes.watch(pods.Informer()); err != nil {
			return nil, err
		}
		a.runnables = append(a.runnables, pods, &sandboxGC{s: a.Sandboxes, ebpf: a.EBPF, sync: pods.WaitForSync, every: SandboxGCPeriod})
		if err := a.addMarker(opts.Kube, pods); err != nil {
			return nil, err
		}
	}
	return a, nil
}

// addMarker adds the redirected marker (--mark-redirected), fed by the socket's
// command results.
func (a *Agent) addMarker(k *Kube, pods PodSource) error {
	cfg := a.Config
	if !cfg.MarkRedirected {
		a.Log.Info("redirected marker off (--mark-redirected=false)")
		return nil
	}
	mesh := capture.Config{ExcludeNamespaces: cfg.ExcludeNamespaces, AgentNamespace: cfg.PodNamespace, IPv6: cfg.IPv6}
	mk, err := NewMarker(k.Client, pods, mesh, a.Log.With("component", "marker"), a.Metrics.Registry)
	if err != nil {
		return err
	}
	a.Socket.OnResult = mk.Observe
	a.runnables = append(a.runnables, mk)
	return nil
}

// Add adds a part to run with the others; call it before Run.
func (a *Agent) Add(r Runnable) { a.runnables = append(a.runnables, r) }

// Run runs every part until ctx ends or one fails, then uninstalls unless
// KeepOnExit says to keep the plugin (keepOnExit).
func (a *Agent) Run(ctx context.Context) error {
	if err := os.MkdirAll(a.Config.RunDir, 0o755); err != nil {
		return fmt.Errorf("run directory: %w", err)
	}
	if st := a.Sandboxes.Open(); st != nil {
		a.EBPF.restore(st.List())
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	errs := make([]error, len(a.runnables))
	for i, r := range a.runnables {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := r.Run(ctx); err != nil {
				errs[i] = fmt.Errorf("%s: %w", r.Name(), err)
				a.Log.Error("agent part failed, stopping", "part", r.Name(), "err", err)
				cancel()
			}
		}()
	}
	wg.Wait()
	err := errors.Join(errs...)
	var cs kubernetes.Interface
	if a.kube != nil {
		cs = a.kube.Client
	}
	keep, why := keepOnExit(a.Config.KeepOnExit, cs, a.Config.PodNamespace, a.Config.DaemonSetName, exitRetryWait)
	if eerr := a.EBPF.exit(!keep, a.Log); eerr != nil {
		a.Log.Error("exit", "err", eerr)
		err = errors.Join(err, eerr)
	}
	if keep {
		a.Log.Info("keeping the plugin installed on exit", "reason", why)
		return err
	}
	a.Log.Info("removing the plugin on exit", "reason", why)
	if uerr := a.Guard.Uninstall(); uerr != nil {
		a.Log.Error("uninstall", "err", uerr)
		err = errors.Join(err, fmt.Errorf("uninstall: %w", uerr))
	} else {
		a.Log.Info("uninstalled the plugin")
	}
	return err
}

// pluginCredential picks the source of the plugin's kubeconfig: --kubeconfig-source
// (outside a pod); in a pod, a token of --plugin-service-account minted by the agent;
// with that empty, the agent's own service-account token (warned: it can read every
// pod and, with repair action delete or label, change them).
func (a *Agent) pluginCredential(opts Options) (install.KubeconfigSource, error) {
	cfg := a.Config
	if cfg.KubeconfigSource != "" {
		return &install.FromFile{Path: cfg.KubeconfigSource}, nil
	}
	ic, err := install.InClusterFromEnv(opts.Getenv, cfg.TokenFile, cfg.CAFile)
	if err != nil {
		return nil, err
	}
	if cfg.PluginServiceAccount == "" {
		a.Log.Warn("the plugin's kubeconfig holds the agent's own token (--plugin-service-account is empty): root on this node can use it to list every pod and, with repair action delete or label, change them; give the plugin its own ServiceAccount (docs/security.md)")
		return ic, nil
	}
	why := ""
	switch {
	case opts.Kube == nil:
		why = "the agent has no API access"
	case cfg.PodNamespace == "" || cfg.NodeName == "":
		why = "the agent's namespace or node is unknown (set --pod-namespace and --node-name from the downward API)"
	}
	if why != "" {
		return nil, fmt.Errorf("the plugin's token (ServiceAccount %s) is minted through the TokenRequest API, bound to the agent's Node, but %s; outside a pod give --kubeconfig-source, or --plugin-service-account= to hand the plugin the agent's own token", cfg.PluginServiceAccount, why)
	}
	holder := &install.Minted{API: ic}
	a.PluginToken = &PluginToken{
		TokenMinter: install.TokenMinter{
			Client:         opts.Kube.Client,
			Namespace:      cfg.PodNamespace,
			ServiceAccount: cfg.PluginServiceAccount,
			NodeName:       cfg.NodeName,
			Expiration:     cfg.PluginTokenExpiration,
			Log:            a.Log.With("component", "plugin-token"),
		},
		Holder:  holder,
		Metrics: a.Metrics,
	}
	return holder, nil
}
