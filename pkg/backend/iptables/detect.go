package iptables

import (
	"bytes"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/pkg/netlink"
)

// NftTables reports whether iptables-nft has tables among listed (netlink.ListTables):
// an ip or ip6 table named nat, mangle or raw.
func NftTables(listed []netlink.Table) bool {
	for _, t := range listed {
		if (t.Family == unix.NFPROTO_IPV4 || t.Family == unix.NFPROTO_IPV6) &&
			(t.Name == "nat" || t.Name == "mangle" || t.Name == "raw") {
			return true
		}
	}
	return false
}

// NftIstio reports, listing the chains over the nfnetlink socket c, whether an
// ip or ip6 table holds an ISTIO_* chain: then iptables-nft holds meshcni's (or
// Istio's) rules. On an error listing, what was listed still counts.
func NftIstio(c *netlink.Conn) (bool, error) {
	chains, err := netlink.ListChains(c)
	for _, ch := range chains {
		if (ch.Family == unix.NFPROTO_IPV4 || ch.Family == unix.NFPROTO_IPV6) && strings.HasPrefix(ch.Name, "ISTIO_") {
			return true, err
		}
	}
	return false, err
}

// LegacyHere reports whether iptables-legacy has tables in the calling thread's
// namespace.
func LegacyHere() bool {
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
