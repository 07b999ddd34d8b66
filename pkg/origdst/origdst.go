// Package origdst reads the original destination of an intercepted TCP connection.
//
// A connection that reached the proxy through an iptables/nftables REDIRECT (or DNAT)
// carries its pre-NAT destination in conntrack; the kernel hands it out through
// getsockopt(SOL_IP, SO_ORIGINAL_DST) for IPv4 and getsockopt(SOL_IPV6,
// IP6T_SO_ORIGINAL_DST) for IPv6. A connection delivered by TPROXY is not NATed: its
// original destination is the accepted socket's own local address.
package origdst

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"unsafe"

	"golang.org/x/sys/unix"
)

const (
	// SOOriginalDst is SO_ORIGINAL_DST (linux/netfilter_ipv4.h), level SOL_IP.
	SOOriginalDst = unix.SO_ORIGINAL_DST
	// IP6TSOOriginalDst is IP6T_SO_ORIGINAL_DST (linux/netfilter_ipv6/ip6_tables.h),
	// level SOL_IPV6.
	IP6TSOOriginalDst = 80
)

// ErrNotRedirected is returned (wrapped) when the kernel has no NAT record for the
// connection: it was not redirected (ENOENT from getsockopt).
var ErrNotRedirected = errors.New("connection has no original destination (not redirected)")

// Redirected returns the pre-NAT destination of a connection accepted on a listener
// that REDIRECT/DNAT rules deliver to. The address family is chosen from the
// connection's local address (a v4-mapped IPv6 socket uses the IPv4 option).
func Redirected(c *net.TCPConn) (netip.AddrPort, error) {
	if c == nil {
		return netip.AddrPort{}, errors.New("original destination: nil connection")
	}
	local, err := localAddrPort(c)
	if err != nil {
		return netip.AddrPort{}, err
	}
	rc, err := c.SyscallConn()
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("original destination: syscall conn: %w", err)
	}
	var (
		ap     netip.AddrPort
		optErr error
	)
	ctlErr := rc.Control(func(fd uintptr) {
		ap, optErr = FromFD(int(fd), local.Addr().Is4() || local.Addr().Is4In6())
	})
	if ctlErr != nil {
		return netip.AddrPort{}, fmt.Errorf("original destination: control: %w", ctlErr)
	}
	if optErr != nil {
		return netip.AddrPort{}, optErr
	}
	return ap, nil
}

// TPROXY returns the original destination of a connection accepted on a transparent
// (IP_TRANSPARENT) listener: its local address, unmapped.
func TPROXY(c *net.TCPConn) (netip.AddrPort, error) {
	if c == nil {
		return netip.AddrPort{}, errors.New("original destination: nil connection")
	}
	return localAddrPort(c)
}

// Of returns the original destination of c: the local address when tproxy is true,
// the conntrack original destination otherwise.
func Of(c *net.TCPConn, tproxy bool) (netip.AddrPort, error) {
	if tproxy {
		return TPROXY(c)
	}
	return Redirected(c)
}

// FromFD runs the getsockopt on a raw socket descriptor: SO_ORIGINAL_DST when ipv4 is
// true, IP6T_SO_ORIGINAL_DST otherwise. The descriptor is neither duplicated nor closed.
func FromFD(fd int, ipv4 bool) (netip.AddrPort, error) {
	// Large enough for sockaddr_in6 (28 bytes) and sockaddr_in (16 bytes).
	var buf [unix.SizeofSockaddrInet6]byte
	level, opt, name := unix.SOL_IP, SOOriginalDst, "SO_ORIGINAL_DST"
	if !ipv4 {
		level, opt, name = unix.SOL_IPV6, IP6TSOOriginalDst, "IP6T_SO_ORIGINAL_DST"
	}
	size := uint32(len(buf))
	_, _, errno := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), uintptr(level), uintptr(opt),
		uintptr(unsafe.Pointer(&buf[0])), uintptr(unsafe.Pointer(&size)), 0)
	if errno != 0 {
		if errno == unix.ENOENT {
			return netip.AddrPort{}, fmt.Errorf("getsockopt %s: %w: %w", name, ErrNotRedirected, errno)
		}
		return netip.AddrPort{}, fmt.Errorf("getsockopt %s: %w", name, errno)
	}
	return parseSockaddr(buf[:size])
}

// parseSockaddr decodes a sockaddr_in or sockaddr_in6 as the kernel wrote it (family in
// host order, port in network order).
func parseSockaddr(b []byte) (netip.AddrPort, error) {
	if len(b) < 2 {
		return netip.AddrPort{}, fmt.Errorf("sockaddr too short: %d bytes", len(b))
	}
	family := *(*uint16)(unsafe.Pointer(&b[0]))
	switch family {
	case unix.AF_INET:
		if len(b) < unix.SizeofSockaddrInet4 {
			return netip.AddrPort{}, fmt.Errorf("sockaddr_in too short: %d bytes", len(b))
		}
		port := binary.BigEndian.Uint16(b[2:4])
		addr := netip.AddrFrom4([4]byte(b[4:8]))
		return netip.AddrPortFrom(addr, port), nil
	case unix.AF_INET6:
		if len(b) < unix.SizeofSockaddrInet6 {
			return netip.AddrPort{}, fmt.Errorf("sockaddr_in6 too short: %d bytes", len(b))
		}
		port := binary.BigEndian.Uint16(b[2:4])
		addr := netip.AddrFrom16([16]byte(b[8:24]))
		return netip.AddrPortFrom(addr, port), nil
	default:
		return netip.AddrPort{}, fmt.Errorf("unexpected sockaddr family %d", family)
	}
}

func localAddrPort(c *net.TCPConn) (netip.AddrPort, error) {
	la, ok := c.LocalAddr().(*net.TCPAddr)
	if !ok || la == nil {
		return netip.AddrPort{}, fmt.Errorf("original destination: local address %v is not TCP", c.LocalAddr())
	}
	ap := la.AddrPort()
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()), nil
}
