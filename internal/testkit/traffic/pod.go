package traffic

import (
	"fmt"
	"net"
	"net/netip"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/netnsutil"
)

// Default addressing of a Pod's eth0 link.
var (
	PodIPv4  = netip.MustParseAddr("10.250.0.2")
	PeerIPv4 = netip.MustParseAddr("10.250.0.1")
	PodIPv6  = netip.MustParseAddr("fd00:250::2")
	PeerIPv6 = netip.MustParseAddr("fd00:250::1")
)

// Link is one veth between the pod namespace and a peer namespace.
type Link struct {
	Name      string // interface name inside the pod (eth0, eth1, ...)
	PeerName  string // interface name inside the peer namespace
	PeerNetNS string
	PodV4     netip.Prefix // pod side, e.g. 10.250.0.2/24
	PeerV4    netip.Prefix // peer side, e.g. 10.250.0.1/24
	PodV6     netip.Prefix
	PeerV6    netip.Prefix
}

// Pod is a "pod" namespace with eth0 to a "peer" namespace (default routes both ways)
// and optional extra links, each to its own peer namespace (connected routes only).
type Pod struct {
	NetNS     string // the pod's namespace path
	PeerNetNS string // eth0's peer namespace path
	IPv4      netip.Addr
	PeerIPv4  netip.Addr
	IPv6      netip.Addr
	PeerIPv6  netip.Addr
	Links     []Link // Links[0] is eth0
}

// PodOption adds to a Pod's setup.
type PodOption func(*[]Link)

// WithExtraInterface adds a veth called name inside the pod, to a new peer namespace;
// pod and peer take the given addresses (prefixes with the same mask; either may be
// invalid to skip that family), e.g. 10.251.0.2/24 and 10.251.0.1/24.
func WithExtraInterface(name string, podV4, peerV4, podV6, peerV6 netip.Prefix) PodOption {
	return func(ls *[]Link) {
		*ls = append(*ls, Link{Name: name, PodV4: podV4, PeerV4: peerV4, PodV6: podV6, PeerV6: peerV6})
	}
}

// NewPod builds a Pod; every namespace goes away when the test ends.
func NewPod(t testing.TB, opts ...PodOption) *Pod {
	t.Helper()
	links := []Link{{
		Name:   "eth0",
		PodV4:  netip.PrefixFrom(PodIPv4, 24),
		PeerV4: netip.PrefixFrom(PeerIPv4, 24),
		PodV6:  netip.PrefixFrom(PodIPv6, 64),
		PeerV6: netip.PrefixFrom(PeerIPv6, 64),
	}}
	for _, o := range opts {
		o(&links)
	}
	pod := &Pod{NetNS: testutil.NewNetns(t), IPv4: PodIPv4, PeerIPv4: PeerIPv4, IPv6: PodIPv6, PeerIPv6: PeerIPv6}
	for i := range links {
		l := &links[i]
		l.PeerNetNS = testutil.NewNetns(t)
		l.PeerName = "veth-" + l.Name
		if err := wire(pod.NetNS, *l, i == 0); err != nil {
			t.Fatalf("pod link %s: %v", l.Name, err)
		}
	}
	pod.PeerNetNS = links[0].PeerNetNS
	pod.Links = links
	return pod
}

// wire creates the veth, addresses both sides and, for eth0, default routes both ways.
func wire(podNS string, l Link, defaultRoutes bool) error {
	peerNS, err := netnsutil.Open(l.PeerNetNS)
	if err != nil {
		return err
	}
	defer unix.Close(peerNS)
	err = InNetns(podNS, func() error {
		veth := &netlink.Veth{
			LinkAttrs:     netlink.LinkAttrs{Name: l.Name},
			PeerName:      l.PeerName,
			PeerNamespace: netlink.NsFd(peerNS),
		}
		if err := netlink.LinkAdd(veth); err != nil {
			return fmt.Errorf("add veth %s: %w", l.Name, err)
		}
		return configure(l.Name, l.PodV4, l.PodV6, l.PeerV4.Addr(), l.PeerV6.Addr(), defaultRoutes)
	})
	if err != nil {
		return err
	}
	return InNetns(l.PeerNetNS, func() error {
		return configure(l.PeerName, l.PeerV4, l.PeerV6, l.PodV4.Addr(), l.PodV6.Addr(), defaultRoutes)
	})
}

func configure(name string, v4, v6 netip.Prefix, gw4, gw6 netip.Addr, defaultRoutes bool) error {
	link, err := netlink.LinkByName(name)
	if err != nil {
		return fmt.Errorf("link %s: %w", name, err)
	}
	for _, p := range []netip.Prefix{v4, v6} {
		if !p.IsValid() {
			continue
		}
		addr := &netlink.Addr{IPNet: prefixNet(p)}
		if p.Addr().Is6() {
			addr.Flags = unix.IFA_F_NODAD
		}
		if err := netlink.AddrAdd(link, addr); err != nil {
			return fmt.Errorf("add %v to %s: %w", p, name, err)
		}
	}
	if err := netlink.LinkSetUp(link); err != nil {
		return fmt.Errorf("set %s up: %w", name, err)
	}
	if !defaultRoutes {
		return nil
	}
	for _, gw := range []netip.Addr{gw4, gw6} {
		if !gw.IsValid() {
			continue
		}
		family := netlink.FAMILY_V4
		if gw.Is6() {
			family = netlink.FAMILY_V6
		}
		r := &netlink.Route{LinkIndex: link.Attrs().Index, Gw: net.IP(gw.AsSlice()), Family: family}
		if err := netlink.RouteAdd(r); err != nil {
			return fmt.Errorf("default route via %v on %s: %w", gw, name, err)
		}
	}
	return nil
}

func prefixNet(p netip.Prefix) *net.IPNet {
	bits := 32
	if p.Addr().Is6() {
		bits = 128
	}
	return &net.IPNet{IP: net.IP(p.Addr().AsSlice()), Mask: net.CIDRMask(p.Bits(), bits)}
}
