package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"time"

	"github.com/spf13/cobra"

	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/engine"
	"github.com/meshcni/meshcni/pkg/istioflags"
	"github.com/meshcni/meshcni/pkg/netnsutil"
	"github.com/meshcni/meshcni/pkg/rules"
	"github.com/meshcni/meshcni/pkg/rules/ipt"
	"github.com/meshcni/meshcni/pkg/spec"
)

func init() { subcommands = append(subcommands, newRulesCmd) }

// rulesFlags are the flags shared by render, apply, check and clean.
type rulesFlags struct {
	istio      *istioflags.Values
	netns      string
	backend    string
	resolvConf string
	timeout    time.Duration
}

func newRulesCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "rules",
		Short: "Render, apply, check or clean the redirect rules (istio-iptables compatible flags)",
		Long: `The rules subcommands take istio-iptables' flags and environment variables
(-p -z -e -u -g -t -r -m -b -d -i -x -q -o -k -c --redirect-dns --capture-all-dns
--drop-invalid, ISTIO_OUTBOUND_OWNER_GROUPS, ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE,
ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR), plus --netns and --backend.

Without --netns they act on the current network namespace, so meshcnictl can serve
as an init container in place of istio-iptables. Without --dual-stack, IPv6 rules
are written when the namespace has a global IPv6 address; DNS servers come from
--resolv-conf, as istio-iptables reads them.`,
	}
	for _, sub := range []struct {
		use, short string
		run        func(context.Context, *cobra.Command, *rulesFlags, *spec.Spec) error
	}{
		{"render", "Print the rules for the given flags (iptables-restore input per family)", runRender},
		{"apply", "Write the rules into the network namespace, atomically", runApply},
		{"check", "Compare the live rules with the desired ones; exit 1 on drift", runCheck},
		{"clean", "Remove meshcni's rules (and nothing else) from the network namespace", nil},
	} {
		sub := sub
		f := &rulesFlags{}
		c := &cobra.Command{Use: sub.use, Short: sub.short, Args: cobra.NoArgs}
		f.istio = istioflags.Register(c.Flags(), os.Getenv)
		c.Flags().StringVar(&f.netns, "netns", "", "network namespace path (e.g. /var/run/netns/NAME or /proc/PID/ns/net); default: the current one")
		c.Flags().StringVar(&f.backend, "backend", "auto", "auto, nftables, iptables-nft or iptables-legacy")
		c.Flags().StringVar(&f.resolvConf, "resolv-conf", "/etc/resolv.conf", "resolv.conf whose nameservers DNS capture uses (with --redirect-dns)")
		c.Flags().DurationVar(&f.timeout, "timeout", 30*time.Second, "give up after this long")
		registerIgnored(c.Flags(), rulesIgnoredBools, rulesIgnoredStrings)
		c.RunE = func(cmd *cobra.Command, _ []string) error {
			ctx, cancel := context.WithTimeout(cmd.Context(), f.timeout)
			defer cancel()
			if sub.run == nil { // clean takes no spec
				kind, err := backend.ParseKind(f.backend)
				if err != nil {
					return err
				}
				if err := engine.Clean(ctx, engine.Options{Backend: kind, NetnsPath: f.netns}); err != nil {
					return err
				}
				fmt.Fprintln(cmd.OutOrStdout(), "meshcni rules removed")
				return nil
			}
			s, err := f.spec(cmd)
			if err != nil {
				return err
			}
			return sub.run(ctx, cmd, f, s)
		}
		cmd.AddCommand(c)
	}
	return cmd
}

// spec builds the spec from the flags, the namespace's addresses and resolv.conf.
func (f *rulesFlags) spec(cmd *cobra.Command) (*spec.Spec, error) {
	s, err := f.istio.Spec()
	if err != nil {
		return nil, err
	}
	if !cmd.Flags().Changed("dual-stack") && os.Getenv("ISTIO_DUAL_STACK") == "" {
		v6, err := hasGlobalIPv6(f.netns)
		if err != nil {
			return nil, err
		}
		s.EnableIPv6 = v6
	}
	if s.RedirectDNS && !s.CaptureAllDNS {
		data, err := os.ReadFile(f.resolvConf)
		if err != nil && !os.IsNotExist(err) {
			return nil, fmt.Errorf("read %s: %w", f.resolvConf, err)
		}
		s.DNSServersV4, s.DNSServersV6 = istioflags.ResolvConfServers(data)
		if !s.DNSEnabled() {
			slog.Warn("--redirect-dns without --capture-all-dns and no nameserver in resolv.conf: DNS capture disabled", "resolv-conf", f.resolvConf)
		}
	}
	return s, s.Validate()
}

func hasGlobalIPv6(netns string) (bool, error) {
	found := false
	err := netnsutil.Do(netns, func() error {
		addrs, err := net.InterfaceAddrs()
		if err != nil {
			return fmt.Errorf("list addresses: %w", err)
		}
		for _, a := range addrs {
			if ipn, ok := a.(*net.IPNet); ok && ipn.IP.To4() == nil && ipn.IP.IsGlobalUnicast() {
				found = true
			}
		}
		return nil
	})
	return found, err
}

func runRender(_ context.Context, cmd *cobra.Command, _ *rulesFlags, s *spec.Spec) error {
	printRules(cmd.OutOrStdout(), rules.Build(s))
	return nil
}

// printRules writes the ruleset as iptables-restore input per enabled family, and
// the TPROXY policy routing, for render and explain.
func printRules(out io.Writer, rs *rules.Ruleset) {
	for _, f := range []struct {
		family rules.Family
		title  string
	}{{rules.V4, "# iptables-restore --noflush input, IPv4"}, {rules.V6, "# ip6tables-restore --noflush input, IPv6"}} {
		if rs.Families.Has(f.family) {
			fmt.Fprintln(out, f.title)
			fmt.Fprint(out, ipt.Restore(rs, f.family))
		}
	}
	if rs.Route != nil {
		fmt.Fprintf(out, "# policy routing: ip rule add fwmark %d lookup %d; ip route add local default dev lo table %d\n", rs.Route.Mark, rs.Route.Table, rs.Route.Table)
	}
}

func runApply(ctx context.Context, cmd *cobra.Command, f *rulesFlags, s *spec.Spec) error {
	kind, err := backend.ParseKind(f.backend)
	if err != nil {
		return err
	}
	start := time.Now()
	used, err := engine.Apply(ctx, engine.Options{Backend: kind, NetnsPath: f.netns}, s)
	if err != nil {
		return err
	}
	fmt.Fprintf(cmd.OutOrStdout(), "meshcni rules applied with %s in %s\n", used, time.Since(start).Round(time.Microsecond))
	return nil
}

func runCheck(ctx context.Context, cmd *cobra.Command, f *rulesFlags, s *spec.Spec) error {
	kind, err := backend.ParseKind(f.backend)
	if err != nil {
		return err
	}
	d, err := engine.Check(ctx, engine.Options{Backend: kind, NetnsPath: f.netns}, s)
	if err != nil {
		return err
	}
	fmt.Fprintln(cmd.OutOrStdout(), d.String())
	if !d.Empty() {
		return &exitError{code: 1, err: fmt.Errorf("live rules drift from the desired ones")}
	}
	return nil
}
