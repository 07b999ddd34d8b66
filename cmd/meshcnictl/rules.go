package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/engine"
	"github.com/meshcni/meshcni/pkg/istioflags"
	"github.com/meshcni/meshcni/pkg/netlink"
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
	ipv6Mode   string
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
as an init container in place of istio-iptables. IPv6 rules are written as
istio-iptables decides from the namespace's addresses: with --dual-stack
(ISTIO_DUAL_STACK) when it has a global IPv6 address, without it only when it has
no global IPv4 address but an IPv6 one. --ipv6-mode says what happens to IPv6
otherwise (istio: it passes; drop: it is dropped but lo, ICMPv6, the proxy's own
and established traffic) or captures it always (capture). DNS servers come from
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
		c.Flags().StringVar(&f.ipv6Mode, "ipv6-mode", string(spec.IPv6Istio), "istio (IPv6 captured when istio-iptables writes IPv6 rules, else it passes), capture (always) or drop (dropped where istio would let it pass)")
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
	if s.IPv6, err = spec.ParseIPv6Mode("--ipv6-mode", f.ipv6Mode); err != nil {
		return nil, err
	}
	addrs, err := netnsAddrs(f.netns)
	if err != nil {
		return nil, err
	}
	s.EnableIPv6 = spec.IstioIPv6(s.EnableIPv6, addrs) // EnableIPv6 holds --dual-stack
	s.EnableIPv4 = true                                // istio-iptables always writes IPv4 rules
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

// netnsAddrs lists the namespace's interface addresses (every one, as
// istio-iptables reads them; spec.IstioIPv6 skips loopback and link-local) over
// pkg/netlink, the product's one address reader.
func netnsAddrs(netns string) ([]netip.Addr, error) {
	c, err := netlink.OpenIn(netns, unix.NETLINK_ROUTE)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	addrs, err := netlink.ListAddrs(c)
	if err != nil {
		return nil, fmt.Errorf("netns %q: %w", netns, err)
	}
	out := make([]netip.Addr, len(addrs))
	for i, a := range addrs {
		out[i] = a.IP
	}
	return out, nil
}

func runRender(_ context.Context, cmd *cobra.Command, _ *rulesFlags, s *spec.Spec) error {
	printRules(cmd.OutOrStdout(), rules.Build(s))
	return nil
}

// printRules writes the ruleset as iptables-restore input per family that has
// rules, and the TPROXY policy routing, for render and explain.
func printRules(out io.Writer, rs *rules.Ruleset) {
	for _, f := range []struct {
		family rules.Family
		title  string
	}{{rules.V4, "# iptables-restore --noflush input, IPv4"}, {rules.V6, "# ip6tables-restore --noflush input, IPv6"}} {
		if in := ipt.Restore(rs, f.family); in != "" {
			fmt.Fprintln(out, f.title)
			fmt.Fprint(out, in)
		}
	}
	if !rs.Families.Has(rules.V6) && ipt.Restore(rs, rules.V6) == "" {
		fmt.Fprintln(out, "# IPv6: no rule, IPv6 passes uncaptured (native nftables: `meta nfproto ipv6 return` first in each base chain)")
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
