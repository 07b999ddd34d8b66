package nftables

import (
	"context"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/pkg/netlink"
	"github.com/meshcni/meshcni/pkg/rules/nft"
)

// Ours returns meshcni's tables among listed (netlink.ListTables): the inet tables
// named as nft.Tables.
func Ours(listed []netlink.Table) []netlink.Table {
	var out []netlink.Table
	for _, t := range listed {
		if t.Family == unix.NFPROTO_INET && ourTable(t.Name) {
			out = append(out, t)
		}
	}
	return out
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

// CleanTables deletes meshcni's tables among listed over the nfnetlink socket c, in
// one batch (all or nothing), and returns how many it deleted. Nothing listed:
// nothing sent.
func CleanTables(c *netlink.Conn, listed []netlink.Table) (int, error) {
	ours := Ours(listed)
	if len(ours) == 0 {
		return 0, nil
	}
	if err := netlink.DeleteTables(c, ours); err != nil {
		return 0, fmt.Errorf("delete tables: %w", err)
	}
	return len(ours), nil
}

// Clean deletes meshcni's three tables, those present, in one batch.
func (b *Backend) Clean(ctx context.Context, netnsPath string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	c, err := netlink.OpenIn(netnsPath, unix.NETLINK_NETFILTER)
	if err != nil {
		return fmt.Errorf("nftables clean: %w", err)
	}
	defer c.Close()
	if b.OnSocket != nil {
		b.OnSocket(c.Fd())
	}
	listed, err := netlink.ListTables(c)
	if err != nil {
		return fmt.Errorf("nftables clean in netns %q: %w", netnsPath, err)
	}
	n, err := CleanTables(c, listed)
	if err != nil {
		return fmt.Errorf("nftables clean in netns %q: %w", netnsPath, err)
	}
	if n > 0 {
		b.log().Debug("nftables tables deleted", "netns", netnsPath, "tables", n)
	}
	return nil
}
