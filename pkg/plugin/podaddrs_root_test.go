package plugin

import (
	"net/netip"
	"slices"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/internal/nl"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/internal/testkit/traffic"
)

// addrMsg is an RTM_NEWADDR body: ifaddrmsg, then IFA_ADDRESS and IFA_LOCAL when valid.
func addrMsg(family, scope uint8, address, local netip.Addr) []byte {
	b := make([]byte, unix.SizeofIfAddrmsg)
	b[0], b[3] = family, scope
	if address.IsValid() {
		b = nl.AppendAttr(b, unix.IFA_ADDRESS, address.AsSlice())
	}
	if local.IsValid() {
		b = nl.AppendAttr(b, unix.IFA_LOCAL, local.AsSlice())
	}
	return b
}

func TestPodAddr(t *testing.T) {
	a := netip.MustParseAddr
	none := netip.Addr{}
	for _, tt := range []struct {
		name string
		typ  uint16
		data []byte
		want netip.Addr // invalid: not a pod address
	}{
		{"ipv4", unix.RTM_NEWADDR, addrMsg(unix.AF_INET, unix.RT_SCOPE_UNIVERSE, a("10.0.0.5"), a("10.0.0.5")), a("10.0.0.5")},
		{"ipv6 (no IFA_LOCAL)", unix.RTM_NEWADDR, addrMsg(unix.AF_INET6, unix.RT_SCOPE_UNIVERSE, a("fd00::5"), none), a("fd00::5")},
		{"point-to-point: IFA_LOCAL is ours, IFA_ADDRESS the peer's", unix.RTM_NEWADDR, addrMsg(unix.AF_INET, unix.RT_SCOPE_UNIVERSE, a("169.254.1.1"), a("10.0.0.5")), a("10.0.0.5")},
		{"loopback ipv4", unix.RTM_NEWADDR, addrMsg(unix.AF_INET, unix.RT_SCOPE_HOST, a("127.0.0.1"), a("127.0.0.1")), none},
		{"loopback ipv6", unix.RTM_NEWADDR, addrMsg(unix.AF_INET6, unix.RT_SCOPE_HOST, a("::1"), none), none},
		{"ipv6 link-local", unix.RTM_NEWADDR, addrMsg(unix.AF_INET6, unix.RT_SCOPE_LINK, a("fe80::1"), none), none},
		{"ipv4 link-local", unix.RTM_NEWADDR, addrMsg(unix.AF_INET, unix.RT_SCOPE_UNIVERSE, a("169.254.3.4"), a("169.254.3.4")), none},
		{"another message type", unix.RTM_NEWLINK, addrMsg(unix.AF_INET, unix.RT_SCOPE_UNIVERSE, a("10.0.0.5"), a("10.0.0.5")), none},
		{"short message", unix.RTM_NEWADDR, []byte{unix.AF_INET, 24}, none},
		{"no address attribute", unix.RTM_NEWADDR, addrMsg(unix.AF_INET, unix.RT_SCOPE_UNIVERSE, none, none), none},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := podAddr(tt.typ, tt.data)
			if ok != tt.want.IsValid() || got != tt.want {
				t.Fatalf("podAddr = %v, %v; want %v", got, ok, tt.want)
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
