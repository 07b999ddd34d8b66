package plugin

import (
	"net/netip"
	"slices"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/internal/testkit/traffic"
	"github.com/meshcni/meshcni/pkg/netlink"
)

func TestPodAddr(t *testing.T) {
	a := netip.MustParseAddr
	for _, tt := range []struct {
		name string
		addr netlink.Addr
		want bool
	}{
		{"ipv4", netlink.Addr{IP: a("10.0.0.5"), Scope: unix.RT_SCOPE_UNIVERSE}, true},
		{"ipv6", netlink.Addr{IP: a("fd00::5"), Scope: unix.RT_SCOPE_UNIVERSE}, true},
		{"loopback ipv4", netlink.Addr{IP: a("127.0.0.1"), Scope: unix.RT_SCOPE_HOST}, false},
		{"loopback ipv6", netlink.Addr{IP: a("::1"), Scope: unix.RT_SCOPE_HOST}, false},
		{"loopback ipv4, scope universe", netlink.Addr{IP: a("127.0.0.2"), Scope: unix.RT_SCOPE_UNIVERSE}, false},
		{"scope host", netlink.Addr{IP: a("10.0.0.6"), Scope: unix.RT_SCOPE_HOST}, false},
		{"scope nowhere", netlink.Addr{IP: a("10.0.0.7"), Scope: unix.RT_SCOPE_NOWHERE}, false},
		{"ipv6 link-local", netlink.Addr{IP: a("fe80::1"), Scope: unix.RT_SCOPE_LINK}, false},
		{"ipv4 link-local", netlink.Addr{IP: a("169.254.3.4"), Scope: unix.RT_SCOPE_UNIVERSE}, false},
		{"no address", netlink.Addr{Scope: unix.RT_SCOPE_UNIVERSE}, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if got := podAddr(tt.addr); got != tt.want {
				t.Fatalf("podAddr(%+v) = %v, want %v", tt.addr, got, tt.want)
			}
		})
	}
}

// TestNetnsAddrs reads real namespaces: a pod with eth0 (IPv4 and IPv6) and net1
// (IPv4 only) gives those three addresses, not lo's nor the links' IPv6 link-local
// ones; a namespace with only lo gives none; a missing one an error.
func TestNetnsAddrs(t *testing.T) {
	testutil.RequireRoot(t)
	pod := traffic.NewPod(t, traffic.WithExtraInterface("net1",
		netip.MustParsePrefix("10.251.0.2/24"), netip.MustParsePrefix("10.251.0.1/24"), netip.Prefix{}, netip.Prefix{}))
	got, err := netnsAddrs(pod.NetNS)
	if err != nil {
		t.Fatal(err)
	}
	want := []netip.Addr{traffic.PodIPv4, netip.MustParseAddr("10.251.0.2"), traffic.PodIPv6}
	slices.SortFunc(got, netip.Addr.Compare)
	slices.SortFunc(want, netip.Addr.Compare)
	if !slices.Equal(got, want) {
		t.Fatalf("addresses %v, want %v", got, want)
	}
	if got, err := netnsAddrs(testutil.NewNetns(t)); err != nil || len(got) != 0 {
		t.Fatalf("lo only: %v, %v; want none", got, err)
	}
	if _, err := netnsAddrs("/run/netns/meshcni-test-missing"); err == nil {
		t.Fatal("a missing netns gave no error")
	}
}
