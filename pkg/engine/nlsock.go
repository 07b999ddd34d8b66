package engine

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// nlsock is a minimal netlink client: one blocking socket (opened in the namespace
// it talks to) and one reused receive buffer, plain system calls. The engine's
// probe and Clean need a few dumps, a batch and some deletes; the general netlink
// libraries cost more than that work in a fresh, short-lived process (a 64 KiB
// buffer per receive, a goroutine per send and receive, a seeded random source per
// socket).
type nlsock struct {
	fd  int
	seq uint32
	buf []byte
}

// nlBufSize bounds one receive. The kernel sizes a dump's messages by the
// receiver's buffer (first one at most a page), so 16 KiB is always enough; a
// truncated message is reported, not misread.
const nlBufSize = 16 << 10

// openNl opens a netlink socket of protocol proto in the calling thread's
// namespace. A NETLINK_NETFILTER socket's duplicate goes to socks (see sockets).
func openNl(proto int, socks *sockets) (*nlsock, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, proto)
	if err != nil {
		return nil, os.NewSyscallError("socket", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		unix.Close(fd)
		return nil, os.NewSyscallError("bind", err)
	}
	if proto == unix.NETLINK_NETFILTER {
		socks.record(fd)
	}
	return &nlsock{fd: fd}, nil
}

func (r *nlsock) close() {
	if r != nil && r.fd >= 0 {
		unix.Close(r.fd)
		r.fd = -1
	}
}

// send writes one request (header + body) and returns its sequence number.
func (r *nlsock) send(typ, flags uint16, body []byte) (uint32, error) {
	r.seq++
	return r.seq, r.write(appendMsg(nil, typ, flags, r.seq, body))
}

// write sends b (one or more messages) to the kernel.
func (r *nlsock) write(b []byte) error {
	for {
		err := unix.Sendto(r.fd, b, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK})
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return os.NewSyscallError("sendto", err)
		}
		return nil
	}
}

// receive reads the replies to request seq, calling each for every message other
// than an error or done one, until the done message (dump) or the acknowledgement
// (ack). A negative acknowledgement is returned as its errno.
func (r *nlsock) receive(seq uint32, each func(typ uint16, data []byte)) error {
	if r.buf == nil {
		r.buf = make([]byte, nlBufSize)
	}
	for {
		n, _, err := unix.Recvfrom(r.fd, r.buf, unix.MSG_TRUNC)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return os.NewSyscallError("recvfrom", err)
		}
		if n > len(r.buf) {
			return fmt.Errorf("netlink message of %d bytes truncated to %d", n, len(r.buf))
		}
		b := r.buf[:n]
		for len(b) >= unix.SizeofNlMsghdr {
			l := int(binary.NativeEndian.Uint32(b[0:4]))
			if l < unix.SizeofNlMsghdr || l > len(b) {
				return fmt.Errorf("malformed netlink message (length %d of %d)", l, len(b))
			}
			typ := binary.NativeEndian.Uint16(b[4:6])
			mseq := binary.NativeEndian.Uint32(b[8:12])
			data := b[unix.SizeofNlMsghdr:l]
			b = b[nlAlign(l):]
			if mseq != seq {
				continue // a late reply to an earlier request
			}
			switch typ {
			case unix.NLMSG_DONE:
				return nil
			case unix.NLMSG_ERROR:
				if len(data) < 4 {
					return errors.New("short netlink error message")
				}
				if e := int32(binary.NativeEndian.Uint32(data[0:4])); e != 0 {
					return unix.Errno(-e)
				}
				return nil // acknowledgement
			}
			each(typ, data)
		}
	}
}

// dump runs a dump request and calls each for every message of it.
func (r *nlsock) dump(typ uint16, body []byte, each func(typ uint16, data []byte)) error {
	seq, err := r.send(typ, unix.NLM_F_DUMP, body)
	if err != nil {
		return err
	}
	return r.receive(seq, each)
}

// do sends a request with an acknowledgement and returns the kernel's answer.
func (r *nlsock) do(typ uint16, body []byte) error {
	seq, err := r.send(typ, unix.NLM_F_ACK, body)
	if err != nil {
		return err
	}
	return r.receive(seq, func(uint16, []byte) {})
}

func nlAlign(n int) int { return (n + unix.NLMSG_ALIGNTO - 1) &^ (unix.NLMSG_ALIGNTO - 1) }

func rtaAlign(n int) int { return (n + unix.RTA_ALIGNTO - 1) &^ (unix.RTA_ALIGNTO - 1) }

// attrs calls each for every route attribute in b (a message's attribute area).
func attrs(b []byte, each func(typ uint16, val []byte)) {
	for len(b) >= unix.SizeofRtAttr {
		l := int(binary.NativeEndian.Uint16(b[0:2]))
		if l < unix.SizeofRtAttr || l > len(b) {
			return
		}
		each(binary.NativeEndian.Uint16(b[2:4])&^unix.NLA_F_NESTED, b[unix.SizeofRtAttr:l])
		if rtaAlign(l) >= len(b) {
			return
		}
		b = b[rtaAlign(l):]
	}
}

// appendAttr appends one route attribute.
func appendAttr(b []byte, typ uint16, val []byte) []byte {
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

// appendMsg appends one netlink message (header + body) with sequence number seq.
func appendMsg(b []byte, typ, flags uint16, seq uint32, body []byte) []byte {
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
func (r *nlsock) acks(first, last uint32, want int) (errs map[uint32]error, err error) {
	if r.buf == nil {
		r.buf = make([]byte, nlBufSize)
	}
	errs = map[uint32]error{}
	got := 0
	for got < want {
		n, _, err := unix.Recvfrom(r.fd, r.buf, unix.MSG_TRUNC|unix.MSG_DONTWAIT)
		if err == unix.EINTR {
			continue
		}
		if err == unix.EAGAIN {
			if len(errs) > 0 {
				return errs, nil
			}
			return errs, fmt.Errorf("nftables batch: %d of %d commands unanswered", want-got, want)
		}
		if err != nil {
			return errs, os.NewSyscallError("recvfrom", err)
		}
		if n > len(r.buf) {
			return errs, fmt.Errorf("netlink message of %d bytes truncated to %d", n, len(r.buf))
		}
		b := r.buf[:n]
		for len(b) >= unix.SizeofNlMsghdr {
			l := int(binary.NativeEndian.Uint32(b[0:4]))
			if l < unix.SizeofNlMsghdr || l > len(b) {
				return errs, fmt.Errorf("malformed netlink message (length %d of %d)", l, len(b))
			}
			typ := binary.NativeEndian.Uint16(b[4:6])
			seq := binary.NativeEndian.Uint32(b[8:12])
			data := b[unix.SizeofNlMsghdr:l]
			b = b[nlAlign(l):]
			if typ != unix.NLMSG_ERROR || seq < first || seq > last || len(data) < 4 {
				continue
			}
			e := int32(binary.NativeEndian.Uint32(data[0:4]))
			if seq == first || seq == last {
				if e != 0 {
					return errs, unix.Errno(-e)
				}
				continue
			}
			got++
			if e != 0 {
				errs[seq] = unix.Errno(-e)
			}
		}
	}
	return errs, nil
}
