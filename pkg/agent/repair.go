package agent

import (
	"fmt"
	"path/filepath"
	"strings"

	"github.com/spf13/pflag"

	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/podnetns"
	"github.com/meshcni/meshcni/pkg/repair"
)

// repairFlags registers the repair controller's flags on fs and returns the check
// to run after parsing: it fills the typed fields and rejects bad values.
func (c *Config) repairFlags(fs *pflag.FlagSet) func() error {
	var action, netnsDirs string
	fs.BoolVar(&c.Repair, "repair", true, "run the repair controller: fix this node's meshed pods whose validation init container found no redirect (needs API access and --node-name)")
	fs.StringVar(&action, "repair-action", string(repair.ActionRepair), "what to do to a broken pod: repair (apply its redirect in place), delete (its controller recreates it), label (for operators)")
	fs.StringVar(&c.RepairLabelKey, "repair-label-key", repair.DefaultLabelKey, "label set to \"true\" by --repair-action=label")
	fs.StringVar(&c.RepairLabelSelector, "repair-label-selector", "", "only consider pods matching this label selector (default: all)")
	fs.StringVar(&c.RepairFieldSelector, "repair-field-selector", "", "only consider pods matching this field selector, e.g. metadata.namespace!=batch (default: all)")
	fs.StringVar(&c.RepairInitContainer, "repair-init-container-name", repair.DefaultInitContainer, "name of the validation init container")
	fs.IntVar(&c.RepairExitCode, "repair-exit-code", repair.DefaultExitCode, "exit code of the validation init container that means \"no redirect\"")
	fs.StringVar(&c.RepairMessage, "repair-message", "", "optional regular expression the failed run's termination message must match")
	fs.StringVar(&netnsDirs, "repair-netns-dirs", strings.Join(podnetns.DefaultNetnsDirs, ","), "comma-separated directories of the runtime's pod network namespaces, searched before /proc (repair in place)")
	return func() error {
		a, err := repair.ParseAction(action)
		if err != nil {
			return fmt.Errorf("--repair-action: %w", err)
		}
		c.RepairAction = a
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
	c, err := repair.New(repair.Options{
		Policy:        p,
		Backend:       kind,
		Client:        k.Client,
		Events:        k.Events,
		Pods:          a.Pods,
		Netns:         &podnetns.Finder{NetnsDirs: cfg.RepairNetnsDirs},
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
