package plugin

import (
	"fmt"
	"net/netip"

	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/internal/nl"
	"github.com/meshcni/meshcni/pkg/netnsutil"
)

// netnsAddrs lists the pod's addresses as its netns holds them (RTM_GETADDR dump
// through internal/nl, in the netns): what the plugin takes the IP families from
// when it gets no prevResult (an additional network under Multus), as istio-cni's
// sidecar redirect reads the pod's addresses in the pod's netns. Loopback
// (scope host) and link-local addresses are not the pod's.
func netnsAddrs(netns string) ([]netip.Addr, error) {
	var out []netip.Addr
	err := netnsutil.Do(netns, func() error {
		c, err := nl.Open(unix.NETLINK_ROUTE)
		if err != nil {
			return err
		}
		defer c.Close()
		body := make([]byte, unix.SizeofIfAddrmsg) // family AF_UNSPEC: both
		return c.Dump(unix.RTM_GETADDR, body, func() { out = out[:0] }, func(typ uint16, data []byte) {
			if a, ok := podAddr(typ, data); ok {
				out = append(out, a)
			}
		})
	})
	if err != nil {
		return nil, fmt.Errorf("list the addresses of netns %s: %w", netns, err)
	}
	return out, nil
}

// podAddr decodes one RTM_NEWADDR message: its address, unless it is loopback or
// link-local.
func podAddr(typ uint16, data []byte) (netip.Addr, bool) {
	if typ != unix.RTM_NEWADDR || len(data) < unix.SizeofIfAddrmsg {
		return netip.Addr{}, false
	}
	if scope := data[3]; scope == unix.RT_SCOPE_HOST || scope == unix.RT_SCOPE_NOWHERE {
		return netip.Addr{}, false
	}
	var addr, local netip.Addr
	nl.Attrs(data[unix.SizeofIfAddrmsg:], func(t uint16, v []byte) {
		a, ok := netip.AddrFromSlice(v)
		switch {
		case !ok:
		case t == unix.IFA_ADDRESS:
			addr = a
		case t == unix.IFA_LOCAL:
			local = a
		}
	})
	if local.IsValid() { // IFA_ADDRESS is the peer's on a point-to-point link
		addr = local
	}
	addr = addr.Unmap()
	if !addr.IsValid() || addr.IsLoopback() || addr.IsLinkLocalUnicast() {
		return netip.Addr{}, false
	}
	return addr, true
}
