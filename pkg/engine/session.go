package engine

import (
	"errors"
	"fmt"
	"runtime"

	"golang.org/x/sys/unix"
)

// What a session opens or reads while its thread is in the namespace.
const (
	wantNf     = 1 << iota // an nfnetlink socket
	wantRoute              // an rtnetlink socket
	wantLegacy             // whether iptables-legacy has tables (/proc)
)

// session is what the engine needs from one entry into a namespace: the sockets
// it talks netlink over and what /proc says there. A thread enters the namespace
// once, only to create the sockets (a socket stays in the namespace it was created
// in) and read /proc, and leaves; all netlink I/O then runs from ordinary goroutines.
// (netlink I/O from a thread locked into the namespace is slower: every wait on the
// socket needs a hand-off of the locked thread; see docs/performance.md.)
type session struct {
	nf     *nlsock // wantNf; its duplicate is in socks
	rt     *nlsock // wantRoute
	legacy bool    // wantLegacy
}

// openSession enters netns ("" = the calling thread's namespace, not left) once
// and opens or reads what want asks for. The nftables socket's duplicate goes to
// socks (nil: none), like nftConn's.
func openSession(netns string, want int, socks *sockets) (*session, error) {
	s := &session{}
	err := inNetns(netns, func() error {
		if want&wantNf != 0 {
			c, err := openNl(unix.NETLINK_NETFILTER, socks)
			if err != nil {
				return fmt.Errorf("netlink in netns %q: %w", netns, err)
			}
			s.nf = c
		}
		if want&wantRoute != 0 {
			h, err := openNl(unix.NETLINK_ROUTE, nil)
			if err != nil {
				return fmt.Errorf("rtnetlink in netns %q: %w", netns, err)
			}
			s.rt = h
		}
		if want&wantLegacy != 0 {
			s.legacy = legacyHere()
		}
		return nil
	})
	if err != nil {
		s.close()
		return nil, err
	}
	return s, nil
}

// closeNf closes the nfnetlink socket (its duplicate, if any, stays in socks).
func (s *session) closeNf() {
	s.nf.close()
	s.nf = nil
}

func (s *session) close() {
	s.closeNf()
	s.rt.close()
	s.rt = nil
}

// inNetns runs f with the calling goroutine's thread in the namespace at path ("":
// in its current one), locked to it, and moves the thread back before unlocking
// it. Unlike netnsutil.Do, f runs on the calling goroutine: starting a goroutine
// wakes another thread, which in a fresh process costs more than the rest of the
// entry. If the move back fails (it cannot, short of the kernel refusing to return
// to a namespace the thread just left), the thread stays locked to the caller, so
// no other goroutine ever runs in the pod's namespace, and the error says so.
func inNetns(path string, f func() error) error {
	if path == "" {
		return f()
	}
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open netns %s: %w", path, err)
	}
	defer unix.Close(fd)
	runtime.LockOSThread()
	orig, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("open the thread's netns: %w", err)
	}
	defer unix.Close(orig)
	if err := unix.Setns(fd, unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread() // a failed setns leaves the thread where it was
		return fmt.Errorf("enter netns %s: %w", path, err)
	}
	ferr := f()
	if err := unix.Setns(orig, unix.CLONE_NEWNET); err != nil {
		return errors.Join(ferr, fmt.Errorf("leave netns %s (the calling goroutine stays locked to its thread): %w", path, err))
	}
	runtime.UnlockOSThread()
	return ferr
}
