package engine

import (
	"context"
	"fmt"
	"os"
	"strings"

	"github.com/google/nftables"

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
// explicit setting; else whatever already holds rules in the namespace (meshcni's
// nftables tables, then iptables-nft's, then iptables-legacy's); else native
// nftables. Detection reads netlink and /proc, it never execs.
func Select(ctx context.Context, k backend.Kind, netns string) (backend.Backend, string, error) {
	if k != backend.Auto && k != "" {
		b, err := New(k)
		return b, "explicit setting", err
	}
	hs, err := holders(netns)
	if err != nil {
		return nil, "", err
	}
	if len(hs) > 0 {
		b, err := New(hs[0])
		return b, fmt.Sprintf("the namespace already holds %s rules", hs[0]), err
	}
	b, err := New(backend.Nftables)
	return b, "default (nothing in the namespace yet)", err
}

// holders lists the backends that hold rules in the namespace, in preference order.
func holders(netns string) ([]backend.Kind, error) {
	var kinds []backend.Kind
	err := netnsutil.Do(netns, func() error {
		conn, err := nftables.New()
		if err != nil {
			return fmt.Errorf("netlink: %w", err)
		}
		defer conn.CloseLasting()
		tables, err := conn.ListTables()
		if err != nil {
			return fmt.Errorf("list nftables tables: %w", err)
		}
		var native, xtnft bool
		for _, t := range tables {
			switch {
			case t.Family == nftables.TableFamilyINet && strings.HasPrefix(t.Name, "istio-proxy-"):
				native = true
			case (t.Family == nftables.TableFamilyIPv4 || t.Family == nftables.TableFamilyIPv6) &&
				(t.Name == "nat" || t.Name == "mangle" || t.Name == "raw"):
				xtnft = true
			}
		}
		if native {
			kinds = append(kinds, backend.Nftables)
		}
		if xtnft {
			kinds = append(kinds, backend.IptablesNft)
		}
		for _, f := range []string{"/proc/thread-self/net/ip_tables_names", "/proc/thread-self/net/ip6_tables_names"} {
			if b, err := os.ReadFile(f); err == nil && len(strings.TrimSpace(string(b))) > 0 {
				kinds = append(kinds, backend.IptablesLegacy)
				break
			}
		}
		return nil
	})
	return kinds, err
}
