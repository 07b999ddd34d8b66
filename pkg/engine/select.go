package engine

import (
	"context"
	"fmt"
	"os"
	"strings"

	"github.com/google/nftables"

	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/backend/iptables"
	nftb "github.com/meshcni/meshcni/pkg/backend/nftables"
	"github.com/meshcni/meshcni/pkg/rules/nft"
)

// New returns the backend of an explicit kind.
func New(k backend.Kind) (backend.Backend, error) {
	switch k {
	case backend.IptablesLegacy, backend.IptablesNft:
		return iptables.New(k)
	case backend.Nftables:
		return newNftables()
	}
	return nil, fmt.Errorf("no backend %q", k)
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
	p, err := probeNetns(netns, socks)
	if err != nil {
		return nil, "", err
	}
	if hs := p.holders(); len(hs) > 0 {
		b, err := New(hs[0])
		return b, fmt.Sprintf("the namespace already holds %s rules", hs[0]), err
	}
	b, err := New(backend.Nftables)
	return b, "default (nothing in the namespace yet)", err
}

// probe is what one look at a namespace's tables finds.
type probe struct {
	native  bool              // meshcni's inet tables (nft.Tables)
	ours    []*nftables.Table // … which they are
	xtnft   bool              // iptables-nft tables (ip/ip6 nat, mangle, raw)
	xtIstio bool              // … holding an ISTIO_* chain (only looked for when asked)
	legacy  bool              // iptables-legacy tables (/proc/net/ip{,6}_tables_names)
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

// nftConn opens a lasting netlink socket into the namespace (nftables.Dial) whose
// duplicate socks keeps (nil socks: none).
func nftConn(netns string, socks *sockets) (*nftables.Conn, func(), error) {
	return nftb.Dial(netns, socks.opt())
}

// probeTables lists the namespace's nftables tables on conn (and, when chains is set,
// the chains of the iptables-nft ones).
func probeTables(conn *nftables.Conn, chains bool) (probe, error) {
	var p probe
	tables, err := conn.ListTables()
	if err != nil {
		return p, fmt.Errorf("list nftables tables: %w", err)
	}
	for _, t := range tables {
		switch {
		case t.Family == nftables.TableFamilyINet && ourTable(t.Name):
			p.native = true
			p.ours = append(p.ours, t)
		case (t.Family == nftables.TableFamilyIPv4 || t.Family == nftables.TableFamilyIPv6) &&
			(t.Name == "nat" || t.Name == "mangle" || t.Name == "raw"):
			p.xtnft = true
		}
	}
	if chains && p.xtnft {
		cs, err := conn.ListChains()
		if err != nil {
			return p, fmt.Errorf("list nftables chains: %w", err)
		}
		for _, c := range cs {
			if (c.Table.Family == nftables.TableFamilyIPv4 || c.Table.Family == nftables.TableFamilyIPv6) && strings.HasPrefix(c.Name, "ISTIO_") {
				p.xtIstio = true
				break
			}
		}
	}
	return p, nil
}

// ourTable reports whether an inet table is one meshcni writes.
func ourTable(name string) bool {
	for _, m := range nft.Tables {
		if name == nft.TableName(m) {
			return true
		}
	}
	return false
}

// legacyHere reports whether iptables-legacy has tables in the calling thread's
// namespace.
func legacyHere() bool {
	for _, f := range []string{"/proc/thread-self/net/ip_tables_names", "/proc/thread-self/net/ip6_tables_names"} {
		if b, err := os.ReadFile(f); err == nil && len(strings.TrimSpace(string(b))) > 0 {
			return true
		}
	}
	return false
}

// probeNetns is the whole probe of a namespace, from one entry into it: its
// nftables tables over a netlink socket, and iptables-legacy's from /proc.
func probeNetns(netns string, socks *sockets) (probe, error) {
	ss, err := openSession(netns, wantNft|wantLegacy, socks)
	if err != nil {
		return probe{}, err
	}
	p, err := probeTables(ss.nft, false)
	ss.close()
	p.legacy = ss.legacy
	return p, err
}

// holders lists the backends that hold tables in the namespace, in preference order.
func holders(netns string) ([]backend.Kind, error) {
	p, err := probeNetns(netns, nil)
	return p.holders(), err
}
