package agent

import (
	"fmt"
	"time"

	"github.com/spf13/pflag"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/meshcni/meshcni/pkg/audit"
	"github.com/meshcni/meshcni/pkg/podnetns"
)

// auditFlags registers the audit's flags on fs and returns the check to run after
// parsing: it fills the typed fields and rejects bad values.
func (c *Config) auditFlags(fs *pflag.FlagSet) func() error {
	var action, escaped string
	fs.DurationVar(&c.AuditPeriod, "audit-period", audit.DefaultPeriod, "audit the redirect of every meshed pod of this node at start, when a pod's containers start and every period (jittered ±10 %, the pods spread over 3/4 of it); 0 turns the audit off")
	fs.StringVar(&action, "audit-action", string(audit.ActionRepair), "what the audit does about a pod whose redirect drifted: repair (re-apply it atomically, in place) or report (Warning Event, metric, log line; nothing changed)")
	fs.StringVar(&escaped, "audit-escaped-action", string(audit.ActionRepair), "what the audit does about a meshed pod with no redirect at all, no validation init container and no record of its sandbox's ADD (its sandbox was created while meshcni was not in the CNI chain): repair (apply its redirect in place), evict (through the Eviction API, within --heal-max-evictions; its controller recreates it through the chain; delete is accepted for evict) or report")
	fs.IntVar(&c.AuditConcurrency, "audit-concurrency", audit.DefaultConcurrency, "pods the audit checks at a time")
	fs.BoolVar(&c.AuditFollowAnnotations, "audit-follow-annotations", false, "apply a running pod's changed traffic annotations in place (default: report them; Istio re-reads none)")
	return func() error {
		var err error
		if c.AuditAction, err = audit.ParseAction(action); err != nil {
			return fmt.Errorf("--audit-action: %w", err)
		}
		if c.AuditEscapedAction, err = audit.ParseEscapedAction(escaped); err != nil {
			return fmt.Errorf("--audit-escaped-action: %w", err)
		}
		if c.AuditPeriod < 0 {
			return fmt.Errorf("--audit-period %v: want 0 (off) or a positive duration", c.AuditPeriod)
		}
		if c.AuditPeriod > 0 && c.AuditPeriod < time.Second {
			return fmt.Errorf("--audit-period %v: want at least 1s (or 0: off)", c.AuditPeriod)
		}
		if c.AuditConcurrency < 1 || c.AuditConcurrency > 64 {
			return fmt.Errorf("--audit-concurrency %d: want 1 to 64", c.AuditConcurrency)
		}
		return nil
	}
}

// AddAudit adds the audit when it is on and can run: it needs the agent's API
// access k (Events, delete) and the node's pod cache (--node-name); otherwise it
// logs why it is off. It shares the repair controller's mesh settings, backend and
// netns directories. Call it after New, before Run (Main does).
func (a *Agent) AddAudit(k *Kube) error {
	cfg := a.Config
	switch {
	case cfg.AuditPeriod == 0:
		a.Log.Info("audit off (--audit-period=0)")
		return nil
	case k == nil:
		a.Log.Info("audit off: no Kubernetes API access")
		return nil
	case a.Pods == nil:
		a.Log.Info("audit off: no --node-name")
		return nil
	}
	p, err := cfg.RepairPolicy()
	if err != nil {
		return fmt.Errorf("audit: %w", err)
	}
	kind, err := engineBackend(cfg.Backend)
	if err != nil {
		return fmt.Errorf("audit: --backend: %w", err)
	}
	m, err := audit.NewMetrics(a.Metrics.Registry)
	if err != nil {
		return err
	}
	ev, err := a.heal(k)
	if err != nil {
		return err
	}
	au, err := audit.New(audit.Options{
		Node:              cfg.NodeName,
		Mesh:              p.Mesh,
		Backend:           kind,
		Period:            cfg.AuditPeriod,
		Concurrency:       cfg.AuditConcurrency,
		Action:            cfg.AuditAction,
		EscapedAction:     cfg.AuditEscapedAction,
		FollowAnnotations: cfg.AuditFollowAnnotations,
		InitContainer:     cfg.RepairInitContainer,
		Applied:           a.Sandboxes,
		Pods:              a.Pods,
		Netns:             &podnetns.Locator{Records: a.Sandboxes, NetnsDirs: cfg.RepairNetnsDirs},
		Decisions:         a.Sandboxes,
		Client:            k.Client,
		Evictor:           ev,
		Events:            k.Events,
		ReadyToDelete:     a.Guard.Ready,
		Metrics:           m,
		Log:               a.Log.With("component", "audit"),
	})
	if err != nil {
		return err
	}
	if _, err := a.Pods.Informer().AddEventHandler(auditHandler(au, a.Pods.HasSynced)); err != nil {
		return fmt.Errorf("audit: pod handler: %w", err)
	}
	a.Add(au)
	return nil
}

// auditHandler tells the auditor when a pod's containers start (checked soon) and
// when a pod is deleted (forgotten). Pods added before the cache synced are
// covered by the first round.
func auditHandler(au *audit.Auditor, synced func() bool) cache.ResourceEventHandlerFuncs {
	return cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) {
			if pod, ok := obj.(*corev1.Pod); ok && synced() && audit.StartedContainers(nil, pod) {
				au.ContainersStarted(pod)
			}
		},
		UpdateFunc: func(old, cur any) {
			o, _ := old.(*corev1.Pod)
			c, ok := cur.(*corev1.Pod)
			if ok && audit.StartedContainers(o, c) {
				au.ContainersStarted(c)
			}
		},
		DeleteFunc: func(obj any) {
			if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = t.Obj
			}
			if pod, ok := obj.(*corev1.Pod); ok {
				au.Forget(pod)
			}
		},
	}
}
