package plugin

import (
	"fmt"
	"net/netip"

	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/pkg/netlink"
)

// netnsAddrs lists the pod's addresses as its netns holds them (pkg/netlink's
// address dump over a socket opened in the netns): what the plugin takes the IP
// families from when it gets no prevResult (an additional network under Multus),
// as istio-cni's sidecar redirect reads the pod's addresses in the pod's netns.
// Loopback (scope host) and link-local addresses are not the pod's.
func netnsAddrs(netns string) ([]netip.Addr, error) {
	c, err := netlink.OpenIn(netns, unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("list the addresses of netns %s: %w", netns, err)
	}
	defer c.Close()
	all, err := netlink.ListAddrs(c)
	if err != nil {
		return nil, fmt.Errorf("list the addresses of netns %s: %w", netns, err)
	}
	var out []netip.Addr
	for _, a := range all {
		if podAddr(a) {
			out = append(out, a.IP)
		}
	}
	return out, nil
}

// podAddr reports whether an address of the pod's netns is the pod's: not
// loopback (nor scope host or nowhere), not link-local.
func podAddr(a netlink.Addr) bool {
	if a.Scope == unix.RT_SCOPE_HOST || a.Scope == unix.RT_SCOPE_NOWHERE {
		return false
	}
	return a.IP.IsValid() && !a.IP.IsLoopback() && !a.IP.IsLinkLocalUnicast()
}
