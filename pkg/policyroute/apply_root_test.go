package policyroute_test

import (
	"net/netip"
	"slices"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/netlink"
	"github.com/meshcni/meshcni/pkg/policyroute"
	"github.com/meshcni/meshcni/pkg/rules"
	"github.com/meshcni/meshcni/pkg/spec"
)

// hasPassthrough reports whether ::6 sits on lo in the namespace (read over
// pkg/netlink).
func hasPassthrough(t *testing.T, netns string) bool {
	t.Helper()
	c, err := netlink.OpenIn(netns, unix.NETLINK_ROUTE)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	addrs, err := netlink.ListAddrs(c)
	if err != nil {
		t.Fatal(err)
	}
	return slices.ContainsFunc(addrs, func(a netlink.Addr) bool {
		return a.IP == netip.MustParseAddr("::6") && a.Prefix == 128 && a.Index == 1
	})
}

// TestApplyCheckClean writes the policy routing into real namespaces over
// pkg/netlink: after Apply, Check finds nothing missing and ::6 is on lo when IPv6
// is captured; a second Apply changes nothing and fails nowhere (the rule and ::6
// exist, the route is replaced); after Clean, Check misses the rule and the route of
// each family again and ::6 is gone. A route table above 255 (outside rtmsg's
// one-byte table) works alike.
func TestApplyCheckClean(t *testing.T) {
	testutil.RequireRoot(t)
	for _, tc := range []struct {
		name  string
		ipv6  bool
		table uint32
	}{
		{"tproxy ipv4", false, spec.DefaultTProxyRouteTable},
		{"tproxy dual stack", true, spec.DefaultTProxyRouteTable},
		{"tproxy dual stack, table 300", true, 300},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := spec.PodDefaults()
			s.Mode = spec.ModeTProxy
			s.EnableIPv6 = tc.ipv6
			s.TProxyRouteTable = tc.table
			if err := s.Validate(); err != nil {
				t.Fatal(err)
			}
			rs := rules.Build(&s)
			ns := testutil.NewNetns(t)
			for i := range 2 {
				if err := policyroute.Apply(ns, rs); err != nil {
					t.Fatalf("apply %d: %v", i+1, err)
				}
				if missing, err := policyroute.Check(ns, rs); err != nil || len(missing) > 0 {
					t.Fatalf("after apply %d: missing %v, %v", i+1, missing, err)
				}
			}
			if got := hasPassthrough(t, ns); got != tc.ipv6 {
				t.Errorf("::6 on lo: %v, want %v", got, tc.ipv6)
			}
			if err := policyroute.Clean(ns); err != nil {
				t.Fatal(err)
			}
			missing, err := policyroute.Check(ns, rs)
			if err != nil {
				t.Fatal(err)
			}
			if want := 2 * map[bool]int{false: 1, true: 2}[tc.ipv6]; len(missing) != want {
				t.Errorf("after clean: missing %v, want %d entries (a rule and a route per family)", missing, want)
			}
			if hasPassthrough(t, ns) {
				t.Error("::6 still on lo after clean")
			}
		})
	}
}
