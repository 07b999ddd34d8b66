// Package engine is the one entry point the plugin, the agent's repair and
// meshcnictl use to program a pod: it validates the spec, builds the ruleset,
// chooses a backend, writes the rules and (for TPROXY / IPv6) the policy routing
// and the ::6 passthrough address (pkg/policyroute), and rolls the rules back when
// the routing fails: all-or-nothing. The backends detect and clean their own
// tables; the engine only orchestrates them.
package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/backend/nftables"
	"github.com/meshcni/meshcni/pkg/policyroute"
	"github.com/meshcni/meshcni/pkg/rules"
	"github.com/meshcni/meshcni/pkg/spec"
)

// Options say where and how to apply.
type Options struct {
	// Backend is the explicit choice, or backend.Auto (see Select).
	Backend backend.Kind
	// NetnsPath is the pod's network namespace ("" = the current one).
	NetnsPath string
	Logger    *slog.Logger
	// HandOff, when set, receives duplicates of the nftables netlink sockets the
	// engine used, once their work is done (committed, or failed), before the engine
	// closes them. It must pass them to a process that holds its own copies and
	// closes them after the engine's close (the CNI plugin sends them to the node
	// agent, agentsock.Client.Release): the engine's close is then not the last one
	// and never waits for the kernel's reclaim of deleted nftables objects (see
	// sockets). The engine closes its copies whatever HandOff returns; an error only
	// means that close may wait.
	HandOff func(fds ...int) error
}

func (o Options) log() *slog.Logger {
	if o.Logger != nil {
		return o.Logger
	}
	return slog.Default()
}

// Apply writes the pod's redirect and returns the backend that did it. An explicit
// backend is used without probing the namespace; backend.Auto chooses with one
// netlink listing (the chosen backend then reads what it needs itself). The policy
// routing / ::6 step runs only when the ruleset needs it (TPROXY or IPv6).
func Apply(ctx context.Context, o Options, s *spec.Spec) (backend.Kind, error) {
	if err := s.Validate(); err != nil {
		return "", fmt.Errorf("invalid redirect spec: %w", err)
	}
	rs := rules.Build(s)
	socks := &sockets{}
	defer socks.release(o)
	b, reason, err := selectIn(o.Backend, o.NetnsPath, socks)
	if err != nil {
		return "", err
	}
	b = withSockets(b, socks)
	o.log().Debug("backend chosen", "backend", b.Kind(), "reason", reason, "netns", o.NetnsPath)
	if err := b.Apply(ctx, o.NetnsPath, rs); err != nil {
		return b.Kind(), fmt.Errorf("apply rules with %s: %w", b.Kind(), err)
	}
	if err := policyroute.Apply(o.NetnsPath, rs); err != nil {
		if cerr := b.Clean(ctx, o.NetnsPath); cerr != nil {
			err = errors.Join(err, fmt.Errorf("roll back rules: %w", cerr))
		}
		return b.Kind(), fmt.Errorf("policy routing: %w", err)
	}
	return b.Kind(), nil
}

// Check compares the namespace's live redirect with the spec's (CheckReport
// without the classification).
func Check(ctx context.Context, o Options, s *spec.Spec) (backend.Drift, error) {
	r, err := CheckReport(ctx, o, s)
	return r.Drift, err
}

// Clean removes meshcni's rules from every backend that holds some (an explicit
// backend cleans only itself), and the TPROXY policy routing and ::6.
//
// With backend.Auto, one entry into the namespace opens an nftables and an
// rtnetlink socket and reads whether iptables-legacy has tables there; then, from
// outside, the nftables socket lists the tables and deletes meshcni's own in one
// batch, iptables-nft-save runs only when an iptables-nft table holds an ISTIO_*
// chain, iptables-legacy-save only when iptables-legacy has tables, and the
// rtnetlink socket removes the policy routing and ::6.
func Clean(ctx context.Context, o Options) error {
	socks := &sockets{}
	defer socks.release(o)
	if o.Backend != backend.Auto && o.Backend != "" {
		var errs []error
		b, err := New(o.Backend)
		if err != nil {
			return err
		}
		if err := withSockets(b, socks).Clean(ctx, o.NetnsPath); err != nil {
			errs = append(errs, fmt.Errorf("clean %s: %w", o.Backend, err))
		}
		if err := policyroute.Clean(o.NetnsPath); err != nil {
			errs = append(errs, fmt.Errorf("clean policy routing: %w", err))
		}
		return errors.Join(errs...)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	ss, err := openSession(o.NetnsPath, wantNf|wantRoute|wantLegacy, socks)
	if err != nil {
		return err
	}
	defer ss.close()
	return cleanSession(ctx, o, ss)
}

// cleanSession is Clean (backend auto) over an open session. An error listing the
// nftables tables is returned, but only what depends on the listing is skipped
// (deleting meshcni's tables, iptables-nft when an ISTIO_* chain is found there):
// iptables-legacy and the policy routing are still cleaned.
func cleanSession(ctx context.Context, o Options, ss *session) error {
	p, listed, err := probeTables(ss.nf, true) // on an error listing chains, listed is still known
	if err != nil {
		err = fmt.Errorf("clean %s in netns %q: %w", backend.Nftables, o.NetnsPath, err)
	}
	if n, ferr := nftables.CleanTables(ss.nf, listed); ferr != nil {
		err = errors.Join(err, fmt.Errorf("clean %s in netns %q: %w", backend.Nftables, o.NetnsPath, ferr))
	} else if n > 0 {
		o.log().Debug("nftables tables deleted", "netns", o.NetnsPath, "tables", n)
	}
	ss.closeNf()
	errs := []error{err}
	var kinds []backend.Kind
	if p.xtIstio {
		kinds = append(kinds, backend.IptablesNft)
	}
	if ss.legacy {
		kinds = append(kinds, backend.IptablesLegacy)
	}
	for _, k := range kinds {
		b, err := New(k)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if err := b.Clean(ctx, o.NetnsPath); err != nil {
			errs = append(errs, fmt.Errorf("clean %s: %w", k, err))
		}
	}
	if err := policyroute.CleanConn(ss.rt, ss.ipv6); err != nil {
		errs = append(errs, fmt.Errorf("clean policy routing: %w", err))
	}
	return errors.Join(errs...)
}

// Live returns the live meshcni rules of whichever backends hold them.
func Live(ctx context.Context, o Options) (map[backend.Kind]string, error) {
	kinds := []backend.Kind{o.Backend}
	if o.Backend == backend.Auto || o.Backend == "" {
		var err error
		if kinds, err = holders(o.NetnsPath); err != nil {
			return nil, err
		}
	}
	out := map[backend.Kind]string{}
	for _, k := range kinds {
		b, err := New(k)
		if err != nil {
			return nil, err
		}
		txt, err := b.Live(ctx, o.NetnsPath)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", k, err)
		}
		out[k] = txt
	}
	return out, nil
}
