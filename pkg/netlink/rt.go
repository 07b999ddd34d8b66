package netlink

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net/netip"

	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/pkg/netnsutil"
)

// Addr is one interface address as rtnetlink lists it (RTM_NEWADDR).
type Addr struct {
	// IP is the interface's own address, unmapped: IFA_LOCAL when the message has
	// one (on a point-to-point link IFA_ADDRESS is the peer's), else IFA_ADDRESS.
	IP     netip.Addr
	Prefix uint8  // prefix length
	Scope  uint8  // RT_SCOPE_*
	Index  uint32 // the interface's index
}

// ListAddrs lists the namespace's addresses of every family over the rtnetlink
// socket c. When the dump fails after its retries, what its last attempt listed is
// returned with the error.
func ListAddrs(c *Conn) ([]Addr, error) {
	var out []Addr
	body := make([]byte, unix.SizeofIfAddrmsg) // family AF_UNSPEC: every family
	err := c.Dump(unix.RTM_GETADDR, body, func() { out = out[:0] }, func(typ uint16, data []byte) {
		if a, ok := decodeAddr(typ, data); ok {
			out = append(out, a)
		}
	})
	if err != nil {
		return out, fmt.Errorf("list addresses: %w", err)
	}
	return out, nil
}

// decodeAddr decodes one RTM_NEWADDR message (ifaddrmsg: family, prefixlen,
// flags, scope, index; then attributes); a message without an address is skipped.
func decodeAddr(typ uint16, data []byte) (Addr, bool) {
	if typ != unix.RTM_NEWADDR || len(data) < unix.SizeofIfAddrmsg {
		return Addr{}, false
	}
	a := Addr{Prefix: data[1], Scope: data[3], Index: binary.NativeEndian.Uint32(data[4:8])}
	var addr, local netip.Addr
	Attrs(data[unix.SizeofIfAddrmsg:], func(t uint16, v []byte) {
		ip, ok := netip.AddrFromSlice(v)
		switch {
		case !ok:
		case t == unix.IFA_ADDRESS:
			addr = ip
		case t == unix.IFA_LOCAL:
			local = ip
		}
	})
	if local.IsValid() {
		addr = local
	}
	a.IP = addr.Unmap()
	return a, a.IP.IsValid()
}

// Link is one network interface as rtnetlink lists it (RTM_NEWLINK).
type Link struct {
	Index uint32
	Flags uint32 // IFF_* (unix.IFF_LOOPBACK, unix.IFF_UP, …)
	Name  string
}

// Loopback reports whether the link is a loopback device.
func (l Link) Loopback() bool { return l.Flags&unix.IFF_LOOPBACK != 0 }

// ListLinks lists the namespace's network interfaces over the rtnetlink socket c.
// When the dump fails after its retries, what its last attempt listed is returned
// with the error.
func ListLinks(c *Conn) ([]Link, error) {
	var out []Link
	body := make([]byte, unix.SizeofIfInfomsg)
	err := c.Dump(unix.RTM_GETLINK, body, func() { out = out[:0] }, func(typ uint16, data []byte) {
		if l, ok := decodeLink(typ, data); ok {
			out = append(out, l)
		}
	})
	if err != nil {
		return out, fmt.Errorf("list links: %w", err)
	}
	return out, nil
}

// decodeLink decodes one RTM_NEWLINK message (ifinfomsg: family, pad, type u16,
// index i32, flags u32, change u32; then attributes).
func decodeLink(typ uint16, data []byte) (Link, bool) {
	if typ != unix.RTM_NEWLINK || len(data) < unix.SizeofIfInfomsg {
		return Link{}, false
	}
	l := Link{Index: binary.NativeEndian.Uint32(data[4:8]), Flags: binary.NativeEndian.Uint32(data[8:12])}
	Attrs(data[unix.SizeofIfInfomsg:], func(t uint16, v []byte) {
		if t == unix.IFLA_IFNAME {
			l.Name = string(bytes.TrimRight(v, "\x00"))
		}
	})
	return l, true
}

// OpenIn opens a netlink socket of protocol proto in the namespace at netnsPath
// ("" = the calling thread's): a thread enters it only to create the socket
// (netnsutil.Do), and all I/O over the socket then runs from the caller's
// goroutine.
func OpenIn(netnsPath string, proto int) (*Conn, error) {
	var c *Conn
	err := netnsutil.Do(netnsPath, func() (err error) {
		c, err = Open(proto)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("netlink socket in netns %q: %w", netnsPath, err)
	}
	return c, nil
}
