package netnsutil

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// Cookie returns the cookie of the network namespace at path (a /run/netns bind
// mount, a runtime's netns file or /proc/PID/ns/net), read with SO_NETNS_COOKIE
// (Linux 5.14) from a socket opened inside it: the key of eBPF acceleration's
// allow-list. A raw getsockopt, so the plugin can read it without an eBPF library.
func Cookie(path string) (uint64, error) {
	var cookie uint64
	err := Do(path, func() error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("socket: %w", err)
		}
		defer unix.Close(fd)
		if cookie, err = unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_NETNS_COOKIE); err != nil {
			return fmt.Errorf("SO_NETNS_COOKIE (Linux 5.14): %w", err)
		}
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("netns cookie of %s: %w", path, err)
	}
	return cookie, nil
}
