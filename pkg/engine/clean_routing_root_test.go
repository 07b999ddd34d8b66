package engine

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/backend"
	nl "github.com/meshcni/meshcni/pkg/netlink"
	"github.com/meshcni/meshcni/pkg/netnsutil"
	"github.com/meshcni/meshcni/pkg/spec"
)

// TestCleanIPv6Disabled: in a namespace whose IPv6 is switched off
// (net.ipv6.conf.all.disable_ipv6=1: the closest a namespace gets to a kernel
// booted with ipv6.disable=1, which the pure tests cover), Clean (auto and
// explicit) of an IPv4 TPROXY redirect succeeds and removes its policy routing; a
// namespace with IPv6 is seen to have it.
func TestCleanIPv6Disabled(t *testing.T) {
	testutil.RequireRoot(t)
	s := spec.PodDefaults()
	s.Mode = spec.ModeTProxy
	for _, k := range []backend.Kind{backend.Auto, backend.IptablesLegacy} {
		t.Run(string(k), func(t *testing.T) {
			netns := testutil.NewNetns(t)
			ss, err := openSession(netns, wantRoute, nil)
			if err != nil {
				t.Fatal(err)
			}
			ss.close()
			if !ss.ipv6 {
				t.Fatal("session: no IPv6 in a fresh namespace")
			}
			if _, err := Apply(context.Background(), Options{Backend: k, NetnsPath: netns}, &s); err != nil {
				t.Fatal(err)
			}
			err = netnsutil.Do(netns, func() error {
				for _, f := range []string{"all", "default", "lo"} {
					if err := os.WriteFile("/proc/sys/net/ipv6/conf/"+f+"/disable_ipv6", []byte("1"), 0o644); err != nil {
						return err
					}
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			if len(fwmarkRules(t, netns)) == 0 {
				t.Fatal("no fwmark rule after apply")
			}
			if err := Clean(context.Background(), Options{Backend: k, NetnsPath: netns}); err != nil {
				t.Fatalf("clean with IPv6 disabled: %v", err)
			}
			if got := fwmarkRules(t, netns); len(got) != 0 {
				t.Fatalf("fwmark rules left: %v", got)
			}
		})
	}
}

// TestCleanRouteTables: meshcni's policy routing is removed whatever valid table
// it uses (1-251 and 256 up), both families.
func TestCleanRouteTables(t *testing.T) {
	testutil.RequireRoot(t)
	for _, table := range []uint32{1, 133, 251, 256, 1000, 70000} {
		t.Run(fmt.Sprint(table), func(t *testing.T) {
			netns := testutil.NewNetns(t)
			s := spec.PodDefaults()
			s.Mode = spec.ModeTProxy
			s.EnableIPv6 = true
			s.TProxyRouteTable = table
			if _, err := Apply(context.Background(), Options{Backend: backend.Nftables, NetnsPath: netns}, &s); err != nil {
				t.Fatal(err)
			}
			if got := fwmarkRules(t, netns); len(got) != 2 {
				t.Fatalf("fwmark rules after apply: %v", got)
			}
			if err := Clean(context.Background(), Options{Backend: backend.Auto, NetnsPath: netns}); err != nil {
				t.Fatal(err)
			}
			if got := fwmarkRules(t, netns); len(got) != 0 {
				t.Fatalf("fwmark rules left for table %d: %v", table, got)
			}
		})
	}
}

// TestCleanManyForeignRules: next to meshcni's dual-stack policy routing, 300
// foreign fwmark rules (their dump is more than one 16 KiB receive), some to
// tables 256+, some to tables holding a route that is not a lone local default:
// Clean removes meshcni's and keeps every foreign one.
func TestCleanManyForeignRules(t *testing.T) {
	testutil.RequireRoot(t)
	netns := testutil.NewNetns(t)
	const n = 300
	var want []string
	err := netnsutil.Do(netns, func() error {
		for i := range n {
			r := netlink.NewRule()
			r.Family, r.Mark = unix.AF_INET, uint32(0x1000+i)
			if i%2 == 1 {
				r.Family = unix.AF_INET6
			}
			r.Table = 300 + i // tables 256+ ...
			if i%3 == 0 {
				r.Table = 1 + i%120 // ... and below 252 (not meshcni's 133: a rule to its table is its own)
			}
			if err := netlink.RuleAdd(r); err != nil {
				return fmt.Errorf("rule %d: %w", i, err)
			}
			want = append(want, fmt.Sprintf("%d %d %d", r.Family, r.Mark, r.Table))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	// Foreign tables whose only route is a default one that is not local.
	addFwmarkRule(t, netns, unix.AF_INET, 0x77, 177, false)
	addFwmarkRule(t, netns, unix.AF_INET6, 0x78, 1178, false)
	want = append(want, fmt.Sprintf("%d %d %d", unix.AF_INET, 0x77, 177), fmt.Sprintf("%d %d %d", unix.AF_INET6, 0x78, 1178))
	slices.Sort(want)

	s := spec.PodDefaults()
	s.Mode = spec.ModeTProxy
	s.EnableIPv6 = true
	if _, err := Apply(context.Background(), Options{Backend: backend.Nftables, NetnsPath: netns}, &s); err != nil {
		t.Fatal(err)
	}
	if got := fwmarkRules(t, netns); len(got) != len(want)+2 {
		t.Fatalf("%d fwmark rules after apply, want %d", len(got), len(want)+2)
	}
	// The rule dump really is more than one receive.
	ss, err := openSession(netns, wantRoute, nil)
	if err != nil {
		t.Fatal(err)
	}
	size := 0
	if err := ss.rt.Dump(unix.RTM_GETRULE, make([]byte, unix.SizeofRtMsg), func() { size = 0 }, func(_ uint16, data []byte) {
		size += unix.SizeofNlMsghdr + len(data)
	}); err != nil {
		t.Fatal(err)
	}
	ss.close()
	if size <= nl.BufSize {
		t.Fatalf("rule dump of %d bytes fits one receive of %d", size, nl.BufSize)
	}
	if err := Clean(context.Background(), Options{Backend: backend.Auto, NetnsPath: netns}); err != nil {
		t.Fatal(err)
	}
	if got := fwmarkRules(t, netns); !slices.Equal(got, want) {
		t.Fatalf("after Clean: %d fwmark rules, want the %d foreign ones (%d missing, %d extra)", len(got), len(want), len(without(want, got)), len(without(got, want)))
	}
	if hasPassthrough(t, netns) {
		t.Error("::6 left on lo")
	}
}

// without returns the items of a not in b.
func without(a, b []string) []string {
	var out []string
	for _, x := range a {
		if !slices.Contains(b, x) {
			out = append(out, x)
		}
	}
	return out
}

// TestCleanNftListingFails: when listing the nftables tables fails, Clean (auto)
// returns that error but still removes the iptables-legacy rules and the policy
// routing.
func TestCleanNftListingFails(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "iptables-legacy")
	netns := testutil.NewNetns(t)
	s := spec.PodDefaults()
	s.Mode = spec.ModeTProxy
	ctx := context.Background()
	if _, err := Apply(ctx, Options{Backend: backend.IptablesLegacy, NetnsPath: netns}, &s); err != nil {
		t.Fatal(err)
	}
	ss, err := openSession(netns, wantNf|wantRoute|wantLegacy, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer ss.close()
	if !ss.legacy {
		t.Fatal("session: no iptables-legacy tables after apply")
	}
	ss.nf.Close() // every request on it now fails (EBADF)
	err = cleanSession(ctx, Options{Backend: backend.Auto, NetnsPath: netns}, ss)
	if !errors.Is(err, unix.EBADF) || !strings.Contains(err.Error(), "nftables") {
		t.Fatalf("clean with a failing listing = %v, want its EBADF", err)
	}
	live, err := Live(ctx, Options{Backend: backend.IptablesLegacy, NetnsPath: netns})
	if err != nil {
		t.Fatal(err)
	}
	if txt := live[backend.IptablesLegacy]; strings.Contains(strings.ToLower(txt), "istio") {
		t.Errorf("iptables-legacy rules left:\n%s", txt)
	}
	if got := fwmarkRules(t, netns); len(got) != 0 {
		t.Errorf("fwmark rules left: %v", got)
	}
}
