package engine

import (
	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/backend/nftables"
)

func newNftables() (backend.Backend, error) { return nftables.New(), nil }

// withSockets makes a native nftables backend record its netlink sockets in socks.
func withSockets(b backend.Backend, socks *sockets) backend.Backend {
	if nb, ok := b.(*nftables.Backend); ok && socks != nil {
		nb.SockOptions = append(nb.SockOptions, socks.opt())
	}
	return b
}
