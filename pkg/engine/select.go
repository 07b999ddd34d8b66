package engine

import (
	"context"
	"fmt"

	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/backend/iptables"
	"github.com/meshcni/meshcni/pkg/backend/nftables"
	"github.com/meshcni/meshcni/pkg/netlink"
)

// New returns the backend of an explicit kind.
func New(k backend.Kind) (backend.Backend, error) {
	switch k {
	case backend.IptablesLegacy, backend.IptablesNft:
		return iptables.New(k)
	case backend.Nftables:
		return nftables.New(), nil
	}
	return nil, fmt.Errorf("no backend %q", k)
}

// withSockets makes a native nftables backend record its netlink sockets in socks.
func withSockets(b backend.Backend, socks *sockets) backend.Backend {
	if nb, ok := b.(*nftables.Backend); ok && socks != nil {
		nb.OnSocket = socks.record
	}
	return b
}

// Select returns the backend to use and why. The choice is deterministic: the
// explicit setting (nothing is probed); else whatever already holds rules in the
// namespace (meshcni's nftables tables, then iptables-nft's, then iptables-legacy's);
// else native nftables. Detection reads netlink and /proc, it never execs.
func Select(ctx context.Context, k backend.Kind, netns string) (backend.Backend, string, error) {
	return selectIn(k, netns, nil)
}

func selectIn(k backend.Kind, netns string, socks *sockets) (backend.Backend, string, error) {
	if k != backend.Auto && k != "" {
		b, err := New(k)
		return b, "explicit setting", err
	}
	p, listed, err := probeNetns(netns, socks)
	if err != nil {
		return nil, "", err
	}
	k, reason := backend.Nftables, "default (nothing in the namespace yet)"
	if hs := p.holders(); len(hs) > 0 {
		k, reason = hs[0], fmt.Sprintf("the namespace already holds %s rules", hs[0])
	}
	b, err := New(k)
	if nb, ok := b.(*nftables.Backend); ok {
		nb.Listed = listed // the backend's Apply does not list the tables again
	}
	return b, reason, err
}

// probe is what one look at a namespace's tables finds, each backend judging its
// own: nftables.Ours, iptables.NftTables, iptables.NftIstio, iptables.LegacyHere.
type probe struct {
	native  bool // meshcni's inet tables
	xtnft   bool // iptables-nft tables (ip/ip6 nat, mangle, raw)
	xtIstio bool // … holding an ISTIO_* chain (only looked for when asked)
	legacy  bool // iptables-legacy tables (/proc/net/ip{,6}_tables_names)
}

// holders lists the backends holding tables, in preference order (Select's view:
// any iptables-nft table counts).
func (p probe) holders() []backend.Kind {
	var kinds []backend.Kind
	if p.native {
		kinds = append(kinds, backend.Nftables)
	}
	if p.xtnft {
		kinds = append(kinds, backend.IptablesNft)
	}
	if p.legacy {
		kinds = append(kinds, backend.IptablesLegacy)
	}
	return kinds
}

// probeTables lists the namespace's nftables tables over the nfnetlink socket c
// (and, when chains is set, looks for ISTIO_* chains in the iptables-nft ones).
// listed is what the table listing returned, also with an error.
func probeTables(c *netlink.Conn, chains bool) (p probe, listed []netlink.Table, err error) {
	listed, err = netlink.ListTables(c)
	p.native = len(nftables.Ours(listed)) > 0
	p.xtnft = iptables.NftTables(listed)
	if err != nil {
		return p, listed, err
	}
	if chains && p.xtnft {
		p.xtIstio, err = iptables.NftIstio(c)
	}
	return p, listed, err
}

// probeNetns is the whole probe of a namespace, from one entry into it: its
// nftables tables over a netlink socket, and iptables-legacy's from /proc. listed
// is the table listing (non-nil when it succeeded), for the nftables backend's
// Apply.
func probeNetns(netns string, socks *sockets) (p probe, listed []netlink.Table, err error) {
	ss, err := openSession(netns, wantNf|wantLegacy, socks)
	if err != nil {
		return probe{}, nil, err
	}
	p, listed, err = probeTables(ss.nf, false)
	ss.close()
	p.legacy = ss.legacy
	if err != nil {
		return p, nil, err
	}
	if listed == nil {
		listed = []netlink.Table{} // listed, and empty
	}
	return p, listed, nil
}

// holders lists the backends that hold tables in the namespace, in preference order.
func holders(netns string) ([]backend.Kind, error) {
	p, _, err := probeNetns(netns, nil)
	return p.holders(), err
}
