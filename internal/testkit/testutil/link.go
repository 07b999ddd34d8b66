package testutil

import (
	"fmt"

	"github.com/vishvananda/netlink"
)

// LinkUp sets the named link up in the current network namespace.
func LinkUp(name string) error {
	l, err := netlink.LinkByName(name)
	if err != nil {
		return fmt.Errorf("link %s: %w", name, err)
	}
	if err := netlink.LinkSetUp(l); err != nil {
		return fmt.Errorf("set %s up: %w", name, err)
	}
	return nil
}
