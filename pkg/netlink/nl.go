// Package netlink is meshcni's netlink client: one blocking socket opened in the
// namespace it talks to, one reused receive buffer, plain system calls. Every
// rtnetlink read and write of the product (addresses, links, policy rules and
// routes) and every nfnetlink table listing and delete goes through it (dumps
// retried when the kernel flags them NLM_F_DUMP_INTR); the general netlink
// libraries cost more than that work in a fresh, short-lived process (a 64 KiB
// buffer per receive, a goroutine per send and receive, a seeded random source per
// socket; figures in docs/performance.md). The nftables backend's rule batches and
// rule reads stay on github.com/google/nftables.
package netlink

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// Conn is one netlink socket.
type Conn struct {
	fd   int
	seq  uint32
	buf  []byte
	peer uint32 // the port requests go to: 0, the kernel (tests talk to a socket of their own)
}

// BufSize bounds one receive. The kernel sizes a dump's messages by the
// receiver's buffer (first one at most a page), so 16 KiB is always enough; a
// truncated message is reported, not misread.
const BufSize = 16 << 10

// Open opens a netlink socket of protocol proto (unix.NETLINK_ROUTE,
// unix.NETLINK_NETFILTER) in the calling thread's namespace, with a receive
// timeout of Timeout.
func Open(proto int) (*Conn, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, proto)
	if err != nil {
		return nil, os.NewSyscallError("socket", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		unix.Close(fd)
		return nil, os.NewSyscallError("bind", err)
	}
	if err := SetRcvTimeout(fd, Timeout); err != nil {
		unix.Close(fd)
		return nil, err
	}
	return &Conn{fd: fd}, nil
}

// NewConn wraps an open netlink socket whose requests go to port peer (0: the
// kernel; tests address a socket of their own, see nltest).
func NewConn(fd int, peer uint32) *Conn { return &Conn{fd: fd, peer: peer} }

// Fd is the socket's file descriptor (-1 once closed).
func (r *Conn) Fd() int { return r.fd }

// Close closes the socket (nil or closed: no-op).
func (r *Conn) Close() {
	if r != nil && r.fd >= 0 {
		unix.Close(r.fd)
		r.fd = -1
	}
}

// send writes one request (header + body) and returns its sequence number.
func (r *Conn) send(typ, flags uint16, body []byte) (uint32, error) {
	r.seq++
	return r.seq, r.write(AppendMsg(nil, typ, flags, r.seq, body))
}

// write sends b (one or more messages) to the kernel.
func (r *Conn) write(b []byte) error {
	for {
		err := unix.Sendto(r.fd, b, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK, Pid: r.peer})
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return os.NewSyscallError("sendto", err)
		}
		return nil
	}
}

// Timeout bounds every blocking receive (SO_RCVTIMEO): a reply the kernel never
// sends fails the request instead of hanging a CNI DEL.
const Timeout = 5 * time.Second

// ErrDumpInterrupted: the kernel flagged a dump NLM_F_DUMP_INTR (the table changed
// while it was dumped, so the dump may be inconsistent); dump retries it.
var ErrDumpInterrupted = errors.New("netlink dump interrupted by a concurrent change")

// dumpTries bounds the attempts of a dump the kernel keeps interrupting.
const dumpTries = 3

// SetRcvTimeout sets the socket's receive timeout.
func SetRcvTimeout(fd int, d time.Duration) error {
	tv := unix.NsecToTimeval(d.Nanoseconds())
	return os.NewSyscallError("setsockopt SO_RCVTIMEO", unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv))
}

// receive reads the replies to request seq, calling each for every message other
// than an error or done one, until the done message (dump) or the acknowledgement
// (ack). A negative acknowledgement, or a done message carrying an error, is
// returned as its errno; a dump the kernel flagged interrupted as
// ErrDumpInterrupted (after the whole of it was read); no reply within the
// socket's receive timeout as an error wrapping os.ErrDeadlineExceeded.
func (r *Conn) receive(seq uint32, each func(typ uint16, data []byte)) error {
	if r.buf == nil {
		r.buf = make([]byte, BufSize)
	}
	w := nlWalk{seq: seq}
	for {
		n, _, err := unix.Recvfrom(r.fd, r.buf, unix.MSG_TRUNC)
		if err == unix.EINTR {
			continue
		}
		if err == unix.EAGAIN {
			return fmt.Errorf("netlink request %d: no answer from the kernel in time: %w", seq, os.ErrDeadlineExceeded)
		}
		if err != nil {
			return os.NewSyscallError("recvfrom", err)
		}
		if n > len(r.buf) {
			return fmt.Errorf("netlink message of %d bytes truncated to %d", n, len(r.buf))
		}
		if done, err := w.feed(r.buf[:n], each); done || err != nil {
			return err
		}
	}
}

// nlWalk reads, one receive's buffer at a time, the replies to request seq.
type nlWalk struct {
	seq  uint32
	intr bool // a reply carried NLM_F_DUMP_INTR
}

// feed walks the messages in b (one receive), calling each for every reply to w.seq
// other than an error or done message and skipping replies to other requests. It
// returns done when the request is answered (done message or acknowledgement),
// with the answer's error: a negative acknowledgement's or done message's errno,
// or ErrDumpInterrupted when a reply was flagged NLM_F_DUMP_INTR. A malformed
// length is an error; the last message may lack its padding.
func (w *nlWalk) feed(b []byte, each func(typ uint16, data []byte)) (done bool, err error) {
	for len(b) >= unix.SizeofNlMsghdr {
		l := int(binary.NativeEndian.Uint32(b[0:4]))
		if l < unix.SizeofNlMsghdr || l > len(b) {
			return true, fmt.Errorf("malformed netlink message (length %d of %d)", l, len(b))
		}
		typ := binary.NativeEndian.Uint16(b[4:6])
		flags := binary.NativeEndian.Uint16(b[6:8])
		mseq := binary.NativeEndian.Uint32(b[8:12])
		data := b[unix.SizeofNlMsghdr:l]
		b = b[min(nlAlign(l), len(b)):]
		if mseq != w.seq {
			continue // a late reply to an earlier request
		}
		if flags&unix.NLM_F_DUMP_INTR != 0 {
			w.intr = true
		}
		switch typ {
		case unix.NLMSG_DONE:
			// A dump that fails part-way ends with the error in its done message.
			if len(data) >= 4 {
				if e := int32(binary.NativeEndian.Uint32(data[0:4])); e < 0 {
					return true, unix.Errno(-e)
				}
			}
			if w.intr {
				return true, ErrDumpInterrupted
			}
			return true, nil
		case unix.NLMSG_ERROR:
			if len(data) < 4 {
				return true, errors.New("short netlink error message")
			}
			if e := int32(binary.NativeEndian.Uint32(data[0:4])); e != 0 {
				return true, unix.Errno(-e)
			}
			return true, nil // acknowledgement
		}
		each(typ, data)
	}
	return false, nil
}

// Dump runs a dump request and calls each for every message of it. A dump the
// kernel flags interrupted (the table changed under it) is run again, up to
// dumpTries times in all, calling reset (if not nil) before each retry so the
// caller drops what the inconsistent attempt gave it.
func (r *Conn) Dump(typ uint16, body []byte, reset func(), each func(typ uint16, data []byte)) error {
	var err error
	for try := range dumpTries {
		if try > 0 && reset != nil {
			reset()
		}
		var seq uint32
		if seq, err = r.send(typ, unix.NLM_F_DUMP, body); err != nil {
			return err
		}
		if err = r.receive(seq, each); !errors.Is(err, ErrDumpInterrupted) {
			return err
		}
	}
	return fmt.Errorf("%w (%d tries)", err, dumpTries)
}

// Do sends a request with an acknowledgement and returns the kernel's answer.
func (r *Conn) Do(typ uint16, body []byte) error { return r.DoFlags(typ, 0, body) }

// DoFlags is Do with the request's own flags besides NLM_F_ACK (NLM_F_CREATE,
// NLM_F_EXCL, NLM_F_REPLACE).
func (r *Conn) DoFlags(typ, flags uint16, body []byte) error {
	seq, err := r.send(typ, flags|unix.NLM_F_ACK, body)
	if err != nil {
		return err
	}
	return r.receive(seq, func(uint16, []byte) {})
}

func nlAlign(n int) int { return (n + unix.NLMSG_ALIGNTO - 1) &^ (unix.NLMSG_ALIGNTO - 1) }

func rtaAlign(n int) int { return (n + unix.RTA_ALIGNTO - 1) &^ (unix.RTA_ALIGNTO - 1) }

// nlaTypeMask clears an attribute type's flag bits (NLA_F_NESTED,
// NLA_F_NET_BYTEORDER); x/sys/unix does not define NLA_TYPE_MASK.
const nlaTypeMask = ^uint16(unix.NLA_F_NESTED | unix.NLA_F_NET_BYTEORDER)

// Attrs calls each for every attribute in b (a message's attribute area).
func Attrs(b []byte, each func(typ uint16, val []byte)) {
	for len(b) >= unix.SizeofRtAttr {
		l := int(binary.NativeEndian.Uint16(b[0:2]))
		if l < unix.SizeofRtAttr || l > len(b) {
			return
		}
		each(binary.NativeEndian.Uint16(b[2:4])&nlaTypeMask, b[unix.SizeofRtAttr:l])
		if rtaAlign(l) >= len(b) {
			return
		}
		b = b[rtaAlign(l):]
	}
}

// AppendAttr appends one attribute (route attributes and nfnetlink attributes share
// the layout).
func AppendAttr(b []byte, typ uint16, val []byte) []byte {
	l := unix.SizeofRtAttr + len(val)
	var h [unix.SizeofRtAttr]byte
	binary.NativeEndian.PutUint16(h[0:2], uint16(l))
	binary.NativeEndian.PutUint16(h[2:4], typ)
	b = append(b, h[:]...)
	b = append(b, val...)
	for range rtaAlign(l) - l {
		b = append(b, 0)
	}
	return b
}

// AppendMsg appends one netlink message (header + body) with sequence number seq.
func AppendMsg(b []byte, typ, flags uint16, seq uint32, body []byte) []byte {
	var h [unix.SizeofNlMsghdr]byte
	binary.NativeEndian.PutUint32(h[0:4], uint32(unix.SizeofNlMsghdr+len(body)))
	binary.NativeEndian.PutUint16(h[4:6], typ)
	binary.NativeEndian.PutUint16(h[6:8], flags|unix.NLM_F_REQUEST)
	binary.NativeEndian.PutUint32(h[8:12], seq)
	b = append(b, h[:]...)
	b = append(b, body...)
	for range nlAlign(len(body)) - len(body) {
		b = append(b, 0)
	}
	return b
}

// acks reads, after a batch whose messages first..last were sent, the
// acknowledgements of the want messages that asked for one and returns their
// errors keyed by sequence number; an error answering the batch's begin (first) or
// end (last) refuses the whole batch and is returned as err. nfnetlink processes a
// batch inside the send, so every answer is queued when it returns: the socket is
// read without waiting, and a missing answer is an error, never a hang.
func (r *Conn) acks(first, last uint32, want int) (map[uint32]error, error) {
	if r.buf == nil {
		r.buf = make([]byte, BufSize)
	}
	w := ackWalk{first: first, last: last, errs: map[uint32]error{}}
	for w.got < want {
		n, _, err := unix.Recvfrom(r.fd, r.buf, unix.MSG_TRUNC|unix.MSG_DONTWAIT)
		if err == unix.EINTR {
			continue
		}
		if err == unix.EAGAIN {
			if len(w.errs) > 0 {
				return w.errs, nil
			}
			return w.errs, fmt.Errorf("nftables batch: %d of %d commands unanswered", want-w.got, want)
		}
		if err != nil {
			return w.errs, os.NewSyscallError("recvfrom", err)
		}
		if n > len(r.buf) {
			return w.errs, fmt.Errorf("netlink message of %d bytes truncated to %d", n, len(r.buf))
		}
		if err := w.feed(r.buf[:n]); err != nil {
			return w.errs, err
		}
	}
	return w.errs, nil
}

// ackWalk reads the answers to a batch whose messages first..last were sent.
type ackWalk struct {
	first, last uint32
	errs        map[uint32]error // a command's error by sequence number
	got         int              // commands answered
}

// feed walks the messages in b (one receive), recording the answers to the batch's
// commands and skipping everything else; an error answering the batch's begin or
// end, or a malformed length, is returned. The last message may lack its padding.
func (w *ackWalk) feed(b []byte) error {
	for len(b) >= unix.SizeofNlMsghdr {
		l := int(binary.NativeEndian.Uint32(b[0:4]))
		if l < unix.SizeofNlMsghdr || l > len(b) {
			return fmt.Errorf("malformed netlink message (length %d of %d)", l, len(b))
		}
		typ := binary.NativeEndian.Uint16(b[4:6])
		seq := binary.NativeEndian.Uint32(b[8:12])
		data := b[unix.SizeofNlMsghdr:l]
		b = b[min(nlAlign(l), len(b)):]
		if typ != unix.NLMSG_ERROR || seq < w.first || seq > w.last || len(data) < 4 {
			continue
		}
		e := int32(binary.NativeEndian.Uint32(data[0:4]))
		if seq == w.first || seq == w.last {
			if e != 0 {
				return unix.Errno(-e)
			}
			continue
		}
		w.got++
		if e != 0 {
			w.errs[seq] = unix.Errno(-e)
		}
	}
	return nil
}
