// Package nltest stands in for the kernel in tests of netlink clients: a peer
// socket answering real netlink requests with scripted datagrams, and builders of
// the messages a kernel sends. It encodes messages itself, independently of the
// client under test (pkg/netlink).
package nltest

import (
	"bytes"
	"encoding/binary"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Peer stands in for the kernel on a NETLINK_USERSOCK socket: the client (a
// socket addressed to it) sends real netlink requests over a real socket, and the
// peer answers each with the datagrams its script returns. It lets tests give
// dumpers answers a real kernel gives only under races or other kernels
// (interrupted dumps, errors part-way, other families' routes).
type Peer struct {
	fd   int
	stop chan struct{}
	mu   sync.Mutex
	reqs []uint16 // message type of each request, in order
	done chan struct{}
}

// Req is one request the peer received.
type Req struct {
	Typ  uint16
	Seq  uint32
	Body []byte
	N    int // how many requests of this type came before it
}

// New starts a peer answering with script and returns it with a client socket
// (fd, with a 2 s receive timeout) and the port to address requests to; both
// sockets close at the end of the test.
func New(t *testing.T, script func(r Req) [][]byte) (p *Peer, client int, port uint32) {
	t.Helper()
	open := func() (int, uint32) {
		fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_USERSOCK)
		if err != nil {
			t.Fatal(err)
		}
		if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
			t.Fatal(err)
		}
		sa, err := unix.Getsockname(fd)
		if err != nil {
			t.Fatal(err)
		}
		return fd, sa.(*unix.SockaddrNetlink).Pid
	}
	pfd, pid := open()
	cfd, _ := open()
	if err := RcvTimeout(cfd, 2*time.Second); err != nil {
		t.Fatal(err)
	}
	// The peer wakes every 20 ms to see whether the test is over (a netlink
	// socket cannot be shut down to wake a blocked receive).
	if err := RcvTimeout(pfd, 20*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	p = &Peer{fd: pfd, stop: make(chan struct{}), done: make(chan struct{})}
	go p.serve(script)
	t.Cleanup(func() {
		unix.Close(cfd)
		close(p.stop)
		<-p.done
		unix.Close(pfd)
	})
	return p, cfd, pid
}

// RcvTimeout sets a socket's receive timeout.
func RcvTimeout(fd int, d time.Duration) error {
	tv := unix.NsecToTimeval(d.Nanoseconds())
	return os.NewSyscallError("setsockopt SO_RCVTIMEO", unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv))
}

func (p *Peer) serve(script func(r Req) [][]byte) {
	defer close(p.done)
	buf := make([]byte, 1<<16)
	count := map[uint16]int{}
	for {
		n, from, err := unix.Recvfrom(p.fd, buf, 0)
		if err == unix.EINTR || err == unix.EAGAIN {
			select {
			case <-p.stop:
				return
			default:
				continue
			}
		}
		if err != nil || n < unix.SizeofNlMsghdr {
			return
		}
		l := min(int(binary.NativeEndian.Uint32(buf[0:4])), n)
		r := Req{Typ: binary.NativeEndian.Uint16(buf[4:6]), Seq: binary.NativeEndian.Uint32(buf[8:12]), Body: slices.Clone(buf[unix.SizeofNlMsghdr:l])}
		r.N = count[r.Typ]
		count[r.Typ]++
		p.mu.Lock()
		p.reqs = append(p.reqs, r.Typ)
		p.mu.Unlock()
		for _, d := range script(r) {
			if err := unix.Sendto(p.fd, d, 0, from); err != nil {
				return
			}
		}
	}
}

// Requests lists the message types of the requests received so far, in order.
func (p *Peer) Requests() []uint16 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.reqs)
}

// Msg is one netlink message as the kernel writes it: header, body, and the
// padding to 4 bytes unless unpadded.
func Msg(typ, flags uint16, seq uint32, body []byte, unpadded bool) []byte {
	b := make([]byte, unix.SizeofNlMsghdr, unix.SizeofNlMsghdr+len(body)+3)
	binary.NativeEndian.PutUint32(b[0:4], uint32(unix.SizeofNlMsghdr+len(body)))
	binary.NativeEndian.PutUint16(b[4:6], typ)
	binary.NativeEndian.PutUint16(b[6:8], flags)
	binary.NativeEndian.PutUint32(b[8:12], seq)
	b = append(b, body...)
	if !unpadded {
		for len(b)%4 != 0 {
			b = append(b, 0)
		}
	}
	return b
}

// Errno is an NLMSG_DONE or NLMSG_ERROR payload: the negated errno (0: none).
func Errno(e unix.Errno) []byte {
	return binary.NativeEndian.AppendUint32(nil, uint32(-int32(e)))
}

// Cat joins messages into one receive's buffer.
func Cat(msgs ...[]byte) []byte { return bytes.Join(msgs, nil) }

// Attr appends one attribute (length, type, value, padding to 4 bytes).
func Attr(b []byte, typ uint16, val []byte) []byte {
	b = binary.NativeEndian.AppendUint16(b, uint16(unix.SizeofRtAttr+len(val)))
	b = binary.NativeEndian.AppendUint16(b, typ)
	b = append(b, val...)
	for len(b)%4 != 0 {
		b = append(b, 0)
	}
	return b
}

// Done is a dump's final message, without error.
func Done(seq uint32) []byte {
	return Msg(unix.NLMSG_DONE, unix.NLM_F_MULTI, seq, Errno(0), false)
}

// Ack is an acknowledgement of request seq with errno e (0: success).
func Ack(seq uint32, e unix.Errno) []byte {
	return Msg(unix.NLMSG_ERROR, 0, seq, append(Errno(e), make([]byte, 16)...), false)
}

// NfTable is an NFT_MSG_NEWTABLE dump message of table name in family.
func NfTable(seq uint32, flags uint16, family uint8, name string) []byte {
	body := Attr([]byte{family, unix.NFNETLINK_V0, 0, 0}, unix.NFTA_TABLE_NAME, append([]byte(name), 0))
	return Msg(unix.NFNL_SUBSYS_NFTABLES<<8|unix.NFT_MSG_NEWTABLE, flags|unix.NLM_F_MULTI, seq, body, false)
}

// Rule is an RTM_NEWRULE dump message: family, fwmark mark, lookup table.
func Rule(seq uint32, flags uint16, family uint8, mark, table uint32) []byte {
	body := make([]byte, unix.SizeofRtMsg)
	body[0], body[4], body[7] = family, unix.RT_TABLE_UNSPEC, unix.FR_ACT_TO_TBL
	body = Attr(body, unix.FRA_FWMARK, binary.NativeEndian.AppendUint32(nil, mark))
	body = Attr(body, unix.FRA_TABLE, binary.NativeEndian.AppendUint32(nil, table))
	return Msg(unix.RTM_NEWRULE, flags|unix.NLM_F_MULTI, seq, body, false)
}

// Route is an RTM_NEWROUTE dump message: a default route of type typ in table.
func Route(seq uint32, family uint8, table uint32, typ uint8) []byte {
	body := make([]byte, unix.SizeofRtMsg)
	body[0], body[4], body[7] = family, unix.RT_TABLE_COMPAT, typ
	body = Attr(body, unix.RTA_TABLE, binary.NativeEndian.AppendUint32(nil, table))
	return Msg(unix.RTM_NEWROUTE, unix.NLM_F_MULTI, seq, body, false)
}
