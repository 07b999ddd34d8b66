package engine

import (
	"context"
	"fmt"
	"os"
	"strings"

	"github.com/google/nftables"
	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/backend/iptables"
	"github.com/meshcni/meshcni/pkg/netnsutil"
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
	p, err := probeNetns(netns, false, socks)
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
	native  bool // meshcni's inet tables (istio-proxy-*)
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

// cleaners lists the backends that may hold meshcni's rules (Clean's view: an
// iptables-nft table without any ISTIO_* chain holds none of them, so no
// iptables-nft-save needs to run).
func (p probe) cleaners() []backend.Kind {
	var kinds []backend.Kind
	if p.native {
		kinds = append(kinds, backend.Nftables)
	}
	if p.xtIstio {
		kinds = append(kinds, backend.IptablesNft)
	}
	if p.legacy {
		kinds = append(kinds, backend.IptablesLegacy)
	}
	return kinds
}

// probeNetns lists the namespace's nftables tables (and, when chains is set, the
// chains of the iptables-nft ones) over one netlink socket opened into it by file
// descriptor, then reads whether iptables-legacy has tables (/proc, from a thread in
// the namespace). The netlink exchange deliberately runs outside netnsutil.Do: on a
// thread locked into the namespace every wait on the socket costs a thread hand-off.
func probeNetns(netns string, chains bool, socks *sockets) (probe, error) {
	var p probe
	opts := []nftables.ConnOption{nftables.AsLasting(), nftables.WithSockOptions(socks.opt())}
	if netns != "" {
		fd, err := unix.Open(netns, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return p, fmt.Errorf("open netns %s: %w", netns, err)
		}
		defer unix.Close(fd)
		opts = append(opts, nftables.WithNetNSFd(fd))
	}
	conn, err := nftables.New(opts...)
	if err != nil {
		return p, fmt.Errorf("netlink in netns %q: %w", netns, err)
	}
	defer conn.CloseLasting()
	tables, err := conn.ListTables()
	if err != nil {
		return p, fmt.Errorf("list nftables tables: %w", err)
	}
	for _, t := range tables {
		switch {
		case t.Family == nftables.TableFamilyINet && strings.HasPrefix(t.Name, "istio-proxy-"):
			p.native = true
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
	err = netnsutil.Do(netns, func() error {
		for _, f := range []string{"/proc/thread-self/net/ip_tables_names", "/proc/thread-self/net/ip6_tables_names"} {
			if b, err := os.ReadFile(f); err == nil && len(strings.TrimSpace(string(b))) > 0 {
				p.legacy = true
				break
			}
		}
		return nil
	})
	return p, err
}

// holders lists the backends that hold tables in the namespace, in preference order.
func holders(netns string) ([]backend.Kind, error) {
	p, err := probeNetns(netns, false, nil)
	return p.holders(), err
}
