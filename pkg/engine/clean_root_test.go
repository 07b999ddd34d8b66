package engine

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"testing"

	"github.com/google/nftables"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/backend"
	nftb "github.com/meshcni/meshcni/pkg/backend/nftables"
	"github.com/meshcni/meshcni/pkg/netnsutil"
	"github.com/meshcni/meshcni/pkg/policyroute"
	"github.com/meshcni/meshcni/pkg/rules"
	"github.com/meshcni/meshcni/pkg/spec"
)

// nftConn opens a lasting nftables netlink socket into the namespace (test
// helpers write and read tables with the google/nftables library, independent of
// the engine's own netlink code).
func nftConn(netns string) (*nftables.Conn, func(), error) {
	return nftb.Dial(netns, nil)
}

// probeNs probes the namespace's nftables tables and chains as Clean does.
func probeNs(t *testing.T, netns string) probe {
	t.Helper()
	ss, err := openSession(netns, wantNf, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer ss.close()
	p, _, err := probeTables(ss.nf, true)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// addForeignTable creates a table (with one regular chain) that is not meshcni's.
func addForeignTable(t *testing.T, netns string, fam nftables.TableFamily, name, chain string) {
	t.Helper()
	conn, closeConn, err := nftConn(netns)
	if err != nil {
		t.Fatal(err)
	}
	defer closeConn()
	tb := conn.AddTable(&nftables.Table{Family: fam, Name: name})
	conn.AddChain(&nftables.Chain{Table: tb, Name: chain})
	if err := conn.Flush(); err != nil {
		t.Fatalf("add foreign table %s: %v", name, err)
	}
}

// tableNames lists family/name of every nftables table in the namespace.
func tableNames(t *testing.T, netns string) []string {
	t.Helper()
	conn, closeConn, err := nftConn(netns)
	if err != nil {
		t.Fatal(err)
	}
	defer closeConn()
	ts, err := conn.ListTables()
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, tb := range ts {
		out = append(out, familyName(tb.Family)+" "+tb.Name)
	}
	return out
}

func familyName(f nftables.TableFamily) string {
	switch f {
	case nftables.TableFamilyINet:
		return "inet"
	case nftables.TableFamilyIPv4:
		return "ip"
	case nftables.TableFamilyIPv6:
		return "ip6"
	}
	return "other"
}

// hasPassthrough reports whether ::6 is on lo.
func hasPassthrough(t *testing.T, netns string) bool {
	t.Helper()
	found := false
	err := netnsutil.Do(netns, func() error {
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return err
		}
		addrs, err := netlink.AddrList(lo, unix.AF_INET6)
		if err != nil {
			return err
		}
		for _, a := range addrs {
			if a.IP.Equal(net.ParseIP("::6")) {
				found = true
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return found
}

// TestCleanAuto: whatever backend wrote a dual-stack TPROXY redirect, Clean with
// backend.Auto removes all of it (rules, policy routing, ::6) and nothing else (a
// foreign nftables table survives). With HandOff, the rules are gone before the
// handed-over sockets are closed, and the native backend's sockets are handed over.
func TestCleanAuto(t *testing.T) {
	testutil.RequireRoot(t)
	s := spec.PodDefaults()
	s.Mode = spec.ModeTProxy
	s.EnableIPv6 = true
	for _, k := range []backend.Kind{backend.Nftables, backend.IptablesNft, backend.IptablesLegacy} {
		t.Run(string(k), func(t *testing.T) {
			netns := testutil.NewNetns(t)
			addForeignTable(t, netns, nftables.TableFamilyINet, "foreign", "keep")
			ctx := context.Background()
			if _, err := Apply(ctx, Options{Backend: k, NetnsPath: netns}, &s); err != nil {
				t.Fatalf("apply with %s: %v", k, err)
			}
			missing, err := policyroute.Check(netns, rules.Build(&s))
			if err != nil || len(missing) != 0 || !hasPassthrough(t, netns) {
				t.Fatalf("after apply: missing routing %v (%v), ::6 on lo %v", missing, err, hasPassthrough(t, netns))
			}
			var handed []int
			o := Options{Backend: backend.Auto, NetnsPath: netns, HandOff: func(fds ...int) error {
				for _, fd := range fds {
					d, err := unix.Dup(fd)
					if err != nil {
						return err
					}
					handed = append(handed, d)
				}
				return nil
			}}
			if err := Clean(ctx, o); err != nil {
				t.Fatalf("clean: %v", err)
			}
			// Checked while the handed-over sockets are still open.
			live, err := Live(ctx, Options{Backend: backend.Auto, NetnsPath: netns})
			if err != nil {
				t.Fatal(err)
			}
			for kind, txt := range live {
				if strings.Contains(txt, "ISTIO") || strings.Contains(txt, "istio") {
					t.Errorf("%s rules left after Clean:\n%s", kind, txt)
				}
			}
			if hasPassthrough(t, netns) {
				t.Error("::6 left on lo")
			}
			if missing, err := policyroute.Check(netns, rules.Build(&s)); err != nil || len(missing) != 4 {
				t.Errorf("policy routing left: only %v missing (%v)", missing, err)
			}
			names := strings.Join(tableNames(t, netns), ",")
			if !strings.Contains(names, "inet foreign") || strings.Contains(names, "istio-proxy") {
				t.Errorf("tables after Clean: %s", names)
			}
			if k == backend.Nftables && len(handed) == 0 {
				t.Error("no netlink socket handed over after deleting nftables tables")
			}
			for _, fd := range handed {
				unix.Close(fd)
			}
		})
	}
}

// TestCleanAutoLeavesForeignIptablesNft: an iptables-nft table without any ISTIO_*
// chain holds none of meshcni's rules: the probe says so (so Clean runs no
// iptables-nft-save), and Clean leaves the table and its chain alone.
func TestCleanAutoLeavesForeignIptablesNft(t *testing.T) {
	testutil.RequireRoot(t)
	netns := testutil.NewNetns(t)
	addForeignTable(t, netns, nftables.TableFamilyIPv4, "nat", "FOREIGN")
	p := probeNs(t, netns)
	if !p.xtnft || p.xtIstio || p.native {
		t.Fatalf("probe = %+v, want an iptables-nft table without ISTIO_* chains", p)
	}
	if err := Clean(context.Background(), Options{NetnsPath: netns}); err != nil {
		t.Fatal(err)
	}
	if names := tableNames(t, netns); len(names) != 1 || names[0] != "ip nat" {
		t.Fatalf("tables after Clean: %v, want the foreign ip nat", names)
	}
	// With an ISTIO_* chain the probe sends Clean to iptables-nft.
	addForeignTable(t, netns, nftables.TableFamilyIPv4, "nat", "ISTIO_OUTPUT")
	if p := probeNs(t, netns); !p.xtIstio {
		t.Fatalf("probe = %+v; want an ISTIO_* chain found", p)
	}
}

// TestCleanGoneNetns: a namespace that does not exist is an error naming it (the
// plugin's DEL checks for it first and treats it as success).
func TestCleanGoneNetns(t *testing.T) {
	testutil.RequireRoot(t)
	err := Clean(context.Background(), Options{NetnsPath: "/run/netns/meshcni-does-not-exist"})
	if err == nil || !strings.Contains(err.Error(), "/run/netns/meshcni-does-not-exist") || !errors.Is(err, unix.ENOENT) {
		t.Fatalf("Clean of a missing netns = %v", err)
	}
}

// addFwmarkRule adds `ip rule fwmark mark lookup table` and, when local is set,
// `ip route add local default dev lo table table`, else a unicast route there.
func addFwmarkRule(t *testing.T, netns string, family int, mark uint32, table int, local bool) {
	t.Helper()
	dflt := &net.IPNet{IP: net.IPv4zero.To4(), Mask: net.CIDRMask(0, 32)}
	if family == unix.AF_INET6 {
		dflt = &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}
	}
	err := netnsutil.Do(netns, func() error {
		r := netlink.NewRule()
		r.Family, r.Mark, r.Table = family, mark, table
		if err := netlink.RuleAdd(r); err != nil {
			return err
		}
		route := &netlink.Route{LinkIndex: 1, Dst: dflt, Table: table, Family: family, Type: unix.RTN_LOCAL, Scope: netlink.SCOPE_HOST}
		if !local {
			route.Type, route.Scope = unix.RTN_UNREACHABLE, netlink.SCOPE_UNIVERSE
			route.LinkIndex = 0
		}
		return netlink.RouteAdd(route)
	})
	if err != nil {
		t.Fatalf("add fwmark %d rule to table %d: %v", mark, table, err)
	}
}

// fwmarkRules lists "family mark table" of the namespace's fwmark rules.
func fwmarkRules(t *testing.T, netns string) []string {
	t.Helper()
	var out []string
	err := netnsutil.Do(netns, func() error {
		for _, fam := range []int{unix.AF_INET, unix.AF_INET6} {
			list, err := netlink.RuleList(fam)
			if err != nil {
				return err
			}
			for _, r := range list {
				if r.Mark != 0 {
					out = append(out, fmt.Sprintf("%d %d %d", fam, r.Mark, r.Table))
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(out)
	return out
}

// TestCleanAutoEverything: one namespace holding everything Clean removes at once
// (meshcni's nftables tables, iptables-legacy rules, iptables-nft rules, the TPROXY
// policy routing of both families, ::6 on lo) next to what it must keep (a foreign
// table, fwmark rules whose table is not meshcni's lone local default route): after
// one Clean (auto), each of meshcni's is gone and each foreign one is there.
func TestCleanAutoEverything(t *testing.T) {
	testutil.RequireRoot(t)
	s := spec.PodDefaults()
	s.Mode = spec.ModeTProxy
	s.EnableIPv6 = true
	for _, tc := range []struct {
		name  string
		kinds []backend.Kind // backends that wrote the redirect, in order
	}{
		{"nftables+iptables-legacy", []backend.Kind{backend.Nftables, backend.IptablesLegacy}},
		{"nftables+iptables-nft", []backend.Kind{backend.Nftables, backend.IptablesNft}},
		{"all three", []backend.Kind{backend.Nftables, backend.IptablesNft, backend.IptablesLegacy}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			netns := testutil.NewNetns(t)
			ctx := context.Background()
			addForeignTable(t, netns, nftables.TableFamilyINet, "foreign", "keep")
			addFwmarkRule(t, netns, unix.AF_INET, 0x77, 177, false)  // not a local route
			addFwmarkRule(t, netns, unix.AF_INET6, 0x78, 178, false) // not a local route
			for _, k := range tc.kinds {
				if _, err := Apply(ctx, Options{Backend: k, NetnsPath: netns}, &s); err != nil {
					t.Fatalf("apply with %s: %v", k, err)
				}
			}
			// Each Apply adds its own copy of the rule (the kernel takes duplicates).
			before := fwmarkRules(t, netns)
			if len(before) != 2+2*len(tc.kinds) || !hasPassthrough(t, netns) {
				t.Fatalf("after apply: fwmark rules %v, ::6 on lo %v", before, hasPassthrough(t, netns))
			}
			if err := Clean(ctx, Options{Backend: backend.Auto, NetnsPath: netns}); err != nil {
				t.Fatalf("clean: %v", err)
			}
			for _, k := range []backend.Kind{backend.Nftables, backend.IptablesNft, backend.IptablesLegacy} {
				live, err := Live(ctx, Options{Backend: k, NetnsPath: netns})
				if err != nil {
					t.Fatal(err)
				}
				if txt := live[k]; strings.Contains(strings.ToLower(txt), "istio") {
					t.Errorf("%s rules left after Clean:\n%s", k, txt)
				}
			}
			if hasPassthrough(t, netns) {
				t.Error("::6 left on lo")
			}
			want := []string{fmt.Sprintf("%d %d %d", unix.AF_INET, 0x77, 177), fmt.Sprintf("%d %d %d", unix.AF_INET6, 0x78, 178)}
			slices.Sort(want)
			if got := fwmarkRules(t, netns); !slices.Equal(got, want) {
				t.Errorf("fwmark rules after Clean = %v, want only the foreign %v", got, want)
			}
			if missing, err := policyroute.Check(netns, rules.Build(&s)); err != nil || len(missing) != 4 {
				t.Errorf("policy routing left: only %v missing (%v)", missing, err)
			}
			if names := tableNames(t, netns); !slices.Contains(names, "inet foreign") || strings.Contains(strings.Join(names, ","), "istio-proxy") {
				t.Errorf("tables after Clean: %v", names)
			}
			// A second Clean finds nothing and succeeds.
			if err := Clean(ctx, Options{Backend: backend.Auto, NetnsPath: netns}); err != nil {
				t.Errorf("second clean: %v", err)
			}
		})
	}
}
