package agent

import (
	"fmt"
	"path/filepath"
	"strings"

	"github.com/spf13/pflag"

	"github.com/meshcni/meshcni/pkg/audit"
	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/heal"
	"github.com/meshcni/meshcni/pkg/podnetns"
	"github.com/meshcni/meshcni/pkg/repair"
)

// repairFlags registers the repair controller's flags on fs and returns the check
// to run after parsing: it fills the typed fields and rejects bad values.
func (c *Config) repairFlags(fs *pflag.FlagSet) func() error {
	var action, netnsDirs string
	fs.BoolVar(&c.Repair, "repair", true, "run the repair controller: fix this node's meshed pods whose validation init container found no redirect (needs API access and --node-name)")
	fs.StringVar(&action, "repair-action", string(repair.ActionRepair), "what to do to a broken pod: repair (apply its redirect in place), evict (through the Eviction API, within --heal-max-evictions; its controller recreates it; delete is accepted for evict), label (for operators)")
	fs.IntVar(&c.HealLimits.MaxEvictions, "heal-max-evictions", heal.DefaultMaxEvictions, "evictions (audit and repair together) allowed per --heal-eviction-window; past them the agent evicts nothing more until it restarts")
	fs.DurationVar(&c.HealLimits.Window, "heal-eviction-window", heal.DefaultWindow, "the window of --heal-max-evictions and --heal-max-evict-fraction")
	fs.Float64Var(&c.HealLimits.MaxFraction, "heal-max-evict-fraction", heal.DefaultMaxFraction, "at most this fraction of the node's meshed pods (at least one) evicted per --heal-eviction-window")
	fs.StringVar(&c.RepairLabelKey, "repair-label-key", repair.DefaultLabelKey, "label set to \"true\" by --repair-action=label")
	fs.StringVar(&c.RepairLabelSelector, "repair-label-selector", "", "only consider pods matching this label selector (default: all)")
	fs.StringVar(&c.RepairFieldSelector, "repair-field-selector", "", "only consider pods matching this field selector, e.g. metadata.namespace!=batch (default: all)")
	fs.StringVar(&c.RepairInitContainer, "repair-init-container-name", repair.DefaultInitContainer, "name of the validation init container")
	fs.IntVar(&c.RepairExitCode, "repair-exit-code", repair.DefaultExitCode, "exit code of the validation init container that means \"no redirect\"")
	fs.StringVar(&c.RepairMessage, "repair-message", "", "optional regular expression the failed run's termination message must match")
	fs.StringVar(&netnsDirs, "repair-netns-dirs", strings.Join(podnetns.DefaultNetnsDirs, ","), "comma-separated directories of the runtime's pod network namespaces: where the audit and the repair look for a pod without a sandbox record by its addresses when no pod's process is visible (no host PID namespace); else its sandbox's record, or its cgroup")
	return func() error {
		a, err := repair.ParseAction(action)
		if err != nil {
			return fmt.Errorf("--repair-action: %w", err)
		}
		c.RepairAction = a
		if c.HealLimits.MaxEvictions < 1 || c.HealLimits.Window <= 0 || c.HealLimits.MaxFraction <= 0 {
			return fmt.Errorf("--heal-max-evictions %d, --heal-eviction-window %v, --heal-max-evict-fraction %v: want each more than 0",
				c.HealLimits.MaxEvictions, c.HealLimits.Window, c.HealLimits.MaxFraction)
		}
		if err := c.HealLimits.Check(); err != nil {
			return fmt.Errorf("--heal-*: %w", err)
		}
		if _, err := repair.ParseLabelKey(c.RepairLabelKey); err != nil {
			return fmt.Errorf("--repair-label-key: %w", err)
		}
		if _, err := repair.ParseLabelSelector(c.RepairLabelSelector); err != nil {
			return fmt.Errorf("--repair-label-selector: %w", err)
		}
		if _, err := repair.ParseFieldSelector(c.RepairFieldSelector); err != nil {
			return fmt.Errorf("--repair-field-selector: %w", err)
		}
		if _, err := repair.ParseInitContainer(c.RepairInitContainer); err != nil {
			return fmt.Errorf("--repair-init-container-name: %w", err)
		}
		if _, err := repair.ParseExitCode(c.RepairExitCode); err != nil {
			return fmt.Errorf("--repair-exit-code: %w", err)
		}
		if _, err := repair.ParseMessage(c.RepairMessage); err != nil {
			return fmt.Errorf("--repair-message: %w", err)
		}
		c.RepairNetnsDirs = []string{}
		for _, d := range strings.Split(netnsDirs, ",") {
			if d = strings.TrimSpace(d); d == "" {
				continue
			}
			if !filepath.IsAbs(d) {
				return fmt.Errorf("--repair-netns-dirs: %q: want an absolute path", d)
			}
			c.RepairNetnsDirs = append(c.RepairNetnsDirs, filepath.Clean(d))
		}
		return nil
	}
}

// RepairPolicy is the repair controller's policy from the (validated) configuration.
func (c *Config) RepairPolicy() (repair.Policy, error) {
	p := repair.Policy{
		Node:     c.NodeName,
		Action:   c.RepairAction,
		LabelKey: c.RepairLabelKey,
		Mesh:     capture.Config{ExcludeNamespaces: c.ExcludeNamespaces, AgentNamespace: c.PodNamespace, IPv6: c.IPv6},
		Criteria: repair.Criteria{InitContainer: c.RepairInitContainer},
	}
	var err error
	if p.LabelSelector, err = repair.ParseLabelSelector(c.RepairLabelSelector); err != nil {
		return p, err
	}
	if p.FieldSelector, err = repair.ParseFieldSelector(c.RepairFieldSelector); err != nil {
		return p, err
	}
	if p.Criteria.ExitCode, err = repair.ParseExitCode(c.RepairExitCode); err != nil {
		return p, err
	}
	if p.Criteria.Message, err = repair.ParseMessage(c.RepairMessage); err != nil {
		return p, err
	}
	return p, nil
}

// engineBackend is --backend as an engine kind ("iptables" is iptables-nft, as the
// plugin reads it).
func engineBackend(s string) (backend.Kind, error) {
	if strings.EqualFold(strings.TrimSpace(s), "iptables") {
		return backend.IptablesNft, nil
	}
	return backend.ParseKind(s)
}

// AddRepair adds the repair controller when it is on and can run: it needs the
// agent's API access k (Events, delete, label) and the node's pod cache
// (--node-name); otherwise it logs why it is off. Call it after New, before Run
// (Main does).
func (a *Agent) AddRepair(k *Kube) error {
	cfg := a.Config
	switch {
	case !cfg.Repair:
		a.Log.Info("repair controller off (--repair=false)")
		return nil
	case k == nil:
		a.Log.Info("repair controller off: no Kubernetes API access")
		return nil
	case a.Pods == nil:
		a.Log.Info("repair controller off: no --node-name")
		return nil
	}
	p, err := cfg.RepairPolicy()
	if err != nil {
		return fmt.Errorf("repair: %w", err)
	}
	kind, err := engineBackend(cfg.Backend)
	if err != nil {
		return fmt.Errorf("repair: --backend: %w", err)
	}
	m, err := repair.NewMetrics(a.Metrics.Registry)
	if err != nil {
		return err
	}
	ev, err := a.heal(k)
	if err != nil {
		return err
	}
	c, err := repair.New(repair.Options{
		Policy:        p,
		Backend:       kind,
		Client:        k.Client,
		Events:        k.Events,
		Pods:          a.Pods,
		Netns:         &podnetns.Locator{Records: a.Sandboxes, NetnsDirs: cfg.RepairNetnsDirs},
		Decisions:     a.Sandboxes,
		Evictor:       ev,
		ReadyToDelete: a.Guard.Ready,
		Metrics:       m,
		Log:           a.Log.With("component", "repair"),
	})
	if err != nil {
		return err
	}
	a.Add(c)
	return nil
}

// heal is the agent's one eviction path, shared by the audit and the repair
// controller (one budget for the node): built at the first call. Its breaker's
// state is a /readyz line; its Warning goes to the agent's Pod.
func (a *Agent) heal(k *Kube) (*heal.Evictor, error) {
	if a.evictor != nil {
		return a.evictor, nil
	}
	m, err := heal.NewMetrics(a.Metrics.Registry)
	if err != nil {
		return nil, err
	}
	p, err := a.Config.RepairPolicy()
	if err != nil {
		return nil, err
	}
	e := &heal.Evictor{Client: k.Client, Budget: heal.NewBudget(a.Config.HealLimits), Metrics: m,
		Log: a.Log.With("component", "heal"), Meshed: a.meshedPods(p.Mesh)}
	if a.Guard != nil && a.Guard.Recorder != nil {
		e.Agent = a.Guard.Recorder
	}
	if a.Health != nil {
		prev := a.Health.Detail
		a.Health.Detail = func() string {
			d := ""
			if prev != nil {
				d = prev()
			}
			if open := e.Budget.Open(); open != "" {
				d += "\nevictions stopped: " + open
			}
			return d
		}
	}
	a.evictor = e
	return e, nil
}

// meshedPods counts the node's meshed pods (the eviction fraction's base).
func (a *Agent) meshedPods(mesh capture.Config) func() int {
	return func() int {
		if a.Pods == nil {
			return 0
		}
		n := 0
		for _, pod := range a.Pods.List() {
			if ok, _ := audit.Audited(pod, a.Config.NodeName, mesh); ok {
				n++
			}
		}
		return n
	}
}
