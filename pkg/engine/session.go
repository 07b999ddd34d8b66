package engine

import (
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/pkg/backend/iptables"
	"github.com/meshcni/meshcni/pkg/netlink"
	"github.com/meshcni/meshcni/pkg/netnsutil"
	"github.com/meshcni/meshcni/pkg/policyroute"
)

// What a session opens or reads while its thread is in the namespace.
const (
	wantNf     = 1 << iota // an nfnetlink socket
	wantRoute              // an rtnetlink socket
	wantLegacy             // whether iptables-legacy has tables (/proc)
)

// session is what the engine needs from one entry into a namespace: the sockets
// it talks netlink over and what /proc says there. A thread enters the namespace
// once (netnsutil.Do), only to create the sockets (a socket stays in the namespace
// it was created in) and read /proc, and leaves; all netlink I/O then runs from
// ordinary goroutines. (netlink I/O from a thread locked into the namespace is
// slower: every wait on the socket needs a hand-off of the locked thread; see
// docs/performance.md.)
type session struct {
	nf     *netlink.Conn // wantNf; its duplicate is in socks
	rt     *netlink.Conn // wantRoute
	legacy bool          // wantLegacy
	ipv6   bool          // wantRoute: the namespace has IPv6 (policyroute.IPv6Here)
}

// openSession enters netns ("" = the calling thread's namespace, not left) once
// and opens or reads what want asks for. The nftables socket's duplicate goes to
// socks (nil: none), like the nftables backend's.
func openSession(netns string, want int, socks *sockets) (*session, error) {
	s := &session{}
	err := netnsutil.Do(netns, func() error {
		if want&wantNf != 0 {
			c, err := netlink.Open(unix.NETLINK_NETFILTER)
			if err != nil {
				return fmt.Errorf("netlink in netns %q: %w", netns, err)
			}
			s.nf = c
			socks.record(c.Fd())
		}
		if want&wantRoute != 0 {
			h, err := netlink.Open(unix.NETLINK_ROUTE)
			if err != nil {
				return fmt.Errorf("rtnetlink in netns %q: %w", netns, err)
			}
			s.rt = h
			s.ipv6 = policyroute.IPv6Here()
		}
		if want&wantLegacy != 0 {
			s.legacy = iptables.LegacyHere()
		}
		return nil
	})
	if err != nil {
		s.close()
		return nil, err
	}
	return s, nil
}

// closeNf closes the nfnetlink socket (its duplicate, if any, stays in socks).
func (s *session) closeNf() {
	s.nf.Close()
	s.nf = nil
}

func (s *session) close() {
	s.closeNf()
	s.rt.Close()
	s.rt = nil
}
