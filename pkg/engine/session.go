package engine

import (
	"errors"
	"fmt"
	"runtime"

	"github.com/google/nftables"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// What a session opens or reads while its thread is in the namespace.
const (
	wantNft    = 1 << iota // a lasting nftables netlink socket
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
	nft    *nftables.Conn  // wantNft; its socket's duplicate is in socks
	rt     *netlink.Handle // wantRoute: NETLINK_ROUTE only (never an nfnetlink socket outside socks)
	legacy bool            // wantLegacy
}

// openSession enters netns ("" = the calling thread's namespace, not left) once
// and opens or reads what want asks for. The nftables socket's duplicate goes to
// socks (nil: none), like nftConn's.
func openSession(netns string, want int, socks *sockets) (*session, error) {
	s := &session{}
	err := inNetns(netns, func() error {
		if want&wantNft != 0 {
			c, err := nftables.New(nftables.AsLasting(), nftables.WithSockOptions(socks.opt()))
			if err != nil {
				return fmt.Errorf("netlink in netns %q: %w", netns, err)
			}
			s.nft = c
		}
		if want&wantRoute != 0 {
			h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
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

// closeNft closes the nftables socket (its duplicate, if any, stays in socks).
func (s *session) closeNft() {
	if s.nft != nil {
		_ = s.nft.CloseLasting()
		s.nft = nil
	}
}

func (s *session) close() {
	s.closeNft()
	if s.rt != nil {
		s.rt.Close()
		s.rt = nil
	}
}

// inNetns runs f on a thread in the namespace at path ("" runs f on the calling
// goroutine, in its thread's namespace). Like netnsutil.Do, f runs on a goroutine
// of its own, locked to its thread, which is moved back before it is unlocked; if
// the move back fails, the thread stays locked and dies with the goroutine.
func inNetns(path string, f func() error) error {
	if path == "" {
		return f()
	}
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open netns %s: %w", path, err)
	}
	defer unix.Close(fd)
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("open the thread's netns: %w", err)
			return
		}
		defer unix.Close(orig)
		if err := unix.Setns(fd, unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread() // a failed setns leaves the thread where it was
			errc <- fmt.Errorf("enter netns %s: %w", path, err)
			return
		}
		ferr := f()
		if err := unix.Setns(orig, unix.CLONE_NEWNET); err != nil {
			errc <- errors.Join(ferr, fmt.Errorf("leave netns %s: %w", path, err))
			return
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}
