package netlink

import (
	"encoding/binary"
	"net/netip"
	"testing"

	"golang.org/x/sys/unix"
)

// addrMsg is an RTM_NEWADDR body: ifaddrmsg, then IFA_ADDRESS and IFA_LOCAL when valid.
func addrMsg(family, scope uint8, index uint32, address, local netip.Addr) []byte {
	b := make([]byte, unix.SizeofIfAddrmsg)
	b[0], b[1], b[3] = family, 24, scope
	binary.NativeEndian.PutUint32(b[4:8], index)
	if address.IsValid() {
		b = AppendAttr(b, unix.IFA_ADDRESS, address.AsSlice())
	}
	if local.IsValid() {
		b = AppendAttr(b, unix.IFA_LOCAL, local.AsSlice())
	}
	return b
}

func TestDecodeAddr(t *testing.T) {
	a := netip.MustParseAddr
	none := netip.Addr{}
	for _, tt := range []struct {
		name string
		typ  uint16
		data []byte
		want Addr // IP invalid: skipped
	}{
		{"ipv4", unix.RTM_NEWADDR, addrMsg(unix.AF_INET, unix.RT_SCOPE_UNIVERSE, 2, a("10.0.0.5"), a("10.0.0.5")), Addr{IP: a("10.0.0.5"), Prefix: 24, Index: 2}},
		{"ipv6 (no IFA_LOCAL)", unix.RTM_NEWADDR, addrMsg(unix.AF_INET6, unix.RT_SCOPE_UNIVERSE, 3, a("fd00::5"), none), Addr{IP: a("fd00::5"), Prefix: 24, Index: 3}},
		{"point-to-point: IFA_LOCAL is ours, IFA_ADDRESS the peer's", unix.RTM_NEWADDR, addrMsg(unix.AF_INET, unix.RT_SCOPE_UNIVERSE, 2, a("169.254.1.1"), a("10.0.0.5")), Addr{IP: a("10.0.0.5"), Prefix: 24, Index: 2}},
		{"loopback, scope kept", unix.RTM_NEWADDR, addrMsg(unix.AF_INET, unix.RT_SCOPE_HOST, 1, a("127.0.0.1"), a("127.0.0.1")), Addr{IP: a("127.0.0.1"), Prefix: 24, Scope: unix.RT_SCOPE_HOST, Index: 1}},
		{"v4-mapped address unmapped", unix.RTM_NEWADDR, addrMsg(unix.AF_INET6, unix.RT_SCOPE_UNIVERSE, 2, a("::ffff:10.0.0.9"), none), Addr{IP: a("10.0.0.9"), Prefix: 24, Index: 2}},
		{"another message type", unix.RTM_NEWLINK, addrMsg(unix.AF_INET, unix.RT_SCOPE_UNIVERSE, 2, a("10.0.0.5"), a("10.0.0.5")), Addr{}},
		{"short message", unix.RTM_NEWADDR, []byte{unix.AF_INET, 24}, Addr{}},
		{"no address attribute", unix.RTM_NEWADDR, addrMsg(unix.AF_INET, unix.RT_SCOPE_UNIVERSE, 2, none, none), Addr{}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := decodeAddr(tt.typ, tt.data)
			if ok != tt.want.IP.IsValid() || (ok && got != tt.want) {
				t.Fatalf("decodeAddr = %+v, %v; want %+v", got, ok, tt.want)
			}
		})
	}
}

// linkMsg is an RTM_NEWLINK body: ifinfomsg, then IFLA_IFNAME.
func linkMsg(index, flags uint32, name string) []byte {
	b := make([]byte, unix.SizeofIfInfomsg)
	binary.NativeEndian.PutUint32(b[4:8], index)
	binary.NativeEndian.PutUint32(b[8:12], flags)
	return AppendAttr(b, unix.IFLA_IFNAME, append([]byte(name), 0))
}

func TestDecodeLink(t *testing.T) {
	for _, tt := range []struct {
		name     string
		typ      uint16
		data     []byte
		want     Link
		ok, loop bool
	}{
		{"lo", unix.RTM_NEWLINK, linkMsg(1, unix.IFF_LOOPBACK|unix.IFF_UP, "lo"), Link{Index: 1, Flags: unix.IFF_LOOPBACK | unix.IFF_UP, Name: "lo"}, true, true},
		{"eth0", unix.RTM_NEWLINK, linkMsg(7, unix.IFF_UP, "eth0"), Link{Index: 7, Flags: unix.IFF_UP, Name: "eth0"}, true, false},
		{"another message type", unix.RTM_NEWADDR, linkMsg(7, unix.IFF_UP, "eth0"), Link{}, false, false},
		{"short message", unix.RTM_NEWLINK, []byte{0, 0, 1}, Link{}, false, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := decodeLink(tt.typ, tt.data)
			if ok != tt.ok || got != tt.want || got.Loopback() != tt.loop {
				t.Fatalf("decodeLink = %+v, %v (loopback %v); want %+v, %v (loopback %v)", got, ok, got.Loopback(), tt.want, tt.ok, tt.loop)
			}
		})
	}
}
