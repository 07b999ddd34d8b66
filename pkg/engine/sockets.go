package engine

import "golang.org/x/sys/unix"

// sockets keeps a duplicate of every nftables netlink socket the engine opens, so
// that the engine, not the code that used the socket, makes its last close.
//
// Why: when an nfnetlink socket is released while the kernel still has deleted
// nftables objects waiting to be freed (by anyone: the list is global), the release
// waits for that work, i.e. for an RCU grace period (milliseconds; docs/performance.md).
// A deleted table, or a table replaced by Apply, puts objects on that list. With
// Options.HandOff set, the engine hands its duplicates to a long-lived process (the
// node agent) that closes them, and returns at once; the rules are gone (the batch was
// committed) before the hand-off, only the kernel's memory reclaim happens later.
type sockets struct {
	fds []int
}

// record keeps a duplicate of fd (nil receiver: no-op; best effort: without a
// duplicate the socket closes as usual).
func (s *sockets) record(fd int) {
	if s == nil {
		return
	}
	if d, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0); err == nil {
		s.fds = append(s.fds, d)
	}
}

// release hands the duplicates to o.HandOff (when set), then closes them: after a
// successful hand-off the receiver holds its own copies, so these closes are not the
// last.
func (s *sockets) release(o Options) {
	if s == nil || len(s.fds) == 0 {
		return
	}
	if o.HandOff != nil {
		if err := o.HandOff(s.fds...); err != nil {
			o.log().Debug("netlink sockets not handed off, closing them here", "err", err)
		}
	}
	for _, fd := range s.fds {
		unix.Close(fd)
	}
	s.fds = nil
}
