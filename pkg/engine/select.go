package engine

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/backend/iptables"
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
	native  bool      // meshcni's inet tables (nft.Tables)
	ours    []nfTable // … which they are
	xtnft   bool      // iptables-nft tables (ip/ip6 nat, mangle, raw)
	xtIstio bool      // … holding an ISTIO_* chain (only looked for when asked)
	legacy  bool      // iptables-legacy tables (/proc/net/ip{,6}_tables_names)
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

// nfTable names an nftables table.
type nfTable struct {
	family uint8 // NFPROTO_*
	name   string
}

// nfMsg is the message type of an nf_tables command.
func nfMsg(cmd int) uint16 { return uint16(unix.NFNL_SUBSYS_NFTABLES<<8 | cmd) }

// nfgen is an nfgenmsg header: family, version, resource id (big-endian).
func nfgen(family uint8, resID uint16) []byte {
	return []byte{family, unix.NFNETLINK_V0, byte(resID >> 8), byte(resID)}
}

// nfString returns the string attribute typ of an nf_tables message's attributes.
func nfString(b []byte, typ uint16) string {
	var out string
	attrs(b, func(t uint16, val []byte) {
		if t == typ {
			out = string(bytes.TrimRight(val, "\x00"))
		}
	})
	return out
}

// probeTables lists the namespace's nftables tables over the nfnetlink socket s
// (and, when chains is set, the chains of the iptables-nft ones).
func probeTables(s *nlsock, chains bool) (probe, error) {
	var p probe
	err := s.dump(nfMsg(unix.NFT_MSG_GETTABLE), nfgen(unix.NFPROTO_UNSPEC, 0), func() { p = probe{} }, func(typ uint16, data []byte) {
		if typ != nfMsg(unix.NFT_MSG_NEWTABLE) || len(data) < 4 {
			return
		}
		t := nfTable{family: data[0], name: nfString(data[4:], unix.NFTA_TABLE_NAME)}
		switch {
		case t.family == unix.NFPROTO_INET && ourTable(t.name):
			p.native = true
			p.ours = append(p.ours, t)
		case (t.family == unix.NFPROTO_IPV4 || t.family == unix.NFPROTO_IPV6) &&
			(t.name == "nat" || t.name == "mangle" || t.name == "raw"):
			p.xtnft = true
		}
	})
	if err != nil {
		return p, fmt.Errorf("list nftables tables: %w", err)
	}
	if chains && p.xtnft {
		err := s.dump(nfMsg(unix.NFT_MSG_GETCHAIN), nfgen(unix.NFPROTO_UNSPEC, 0), func() { p.xtIstio = false }, func(typ uint16, data []byte) {
			if typ != nfMsg(unix.NFT_MSG_NEWCHAIN) || len(data) < 4 || (data[0] != unix.NFPROTO_IPV4 && data[0] != unix.NFPROTO_IPV6) {
				return
			}
			if strings.HasPrefix(nfString(data[4:], unix.NFTA_CHAIN_NAME), "ISTIO_") {
				p.xtIstio = true
			}
		})
		if err != nil {
			return p, fmt.Errorf("list nftables chains: %w", err)
		}
	}
	return p, nil
}

// deleteTables deletes tables in one nf_tables batch (all or nothing) over s.
func deleteTables(s *nlsock, tables []nfTable) error {
	first := s.seq + 1
	b := appendMsg(nil, unix.NFNL_MSG_BATCH_BEGIN, 0, first, nfgen(unix.AF_UNSPEC, unix.NFNL_SUBSYS_NFTABLES))
	for i, t := range tables {
		body := appendAttr(nfgen(t.family, 0), unix.NFTA_TABLE_NAME, append([]byte(t.name), 0))
		b = appendMsg(b, nfMsg(unix.NFT_MSG_DELTABLE), unix.NLM_F_ACK, first+1+uint32(i), body)
	}
	last := first + 1 + uint32(len(tables))
	b = appendMsg(b, unix.NFNL_MSG_BATCH_END, 0, last, nfgen(unix.AF_UNSPEC, unix.NFNL_SUBSYS_NFTABLES))
	s.seq = last
	if err := s.write(b); err != nil {
		return err
	}
	errs, err := s.acks(first, last, len(tables))
	if err != nil {
		return err
	}
	var all []error
	for i, t := range tables {
		if e := errs[first+1+uint32(i)]; e != nil {
			all = append(all, fmt.Errorf("table %s: %w", t.name, e))
		}
	}
	return errors.Join(all...)
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
		if nonBlank(f) {
			return true
		}
	}
	return false
}

// nonBlank reports whether the file at path can be read and holds more than
// white space (plain syscalls: os.ReadFile's poller registration and stat would
// double the system calls).
func nonBlank(path string) bool {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return false
	}
	defer unix.Close(fd)
	var buf [256]byte
	for {
		n, err := unix.Read(fd, buf[:])
		if err == unix.EINTR {
			continue
		}
		if err != nil || n <= 0 {
			return false
		}
		if len(bytes.TrimSpace(buf[:n])) > 0 {
			return true
		}
	}
}

// probeNetns is the whole probe of a namespace, from one entry into it: its
// nftables tables over a netlink socket, and iptables-legacy's from /proc.
func probeNetns(netns string, socks *sockets) (probe, error) {
	ss, err := openSession(netns, wantNf|wantLegacy, socks)
	if err != nil {
		return probe{}, err
	}
	p, err := probeTables(ss.nf, false)
	ss.close()
	p.legacy = ss.legacy
	return p, err
}

// holders lists the backends that hold tables in the namespace, in preference order.
func holders(netns string) ([]backend.Kind, error) {
	p, err := probeNetns(netns, nil)
	return p.holders(), err
}
