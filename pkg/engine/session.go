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
	ipv6   bool    // wantRoute: the namespace has IPv6 (/proc/.../net/if_inet6 exists)
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
			s.ipv6 = ipv6Here()
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

// inNetns runs f on a thread in the namespace at path ("": f runs on the calling
// goroutine, in its thread's current namespace). f runs on a goroutine of its own,
// locked to its thread, which moves the thread back and unlocks it when f returns
// or panics; the caller's thread never moves. If the move back fails (it cannot,
// short of the kernel refusing to return to a namespace the thread just left), the
// goroutine exits still locked, so the runtime ends the thread and no goroutine
// ever runs in the pod's namespace by mistake: the agent, a long-lived process,
// probes through here. A panic in f is raised again in the caller.
func inNetns(path string, f func() error) error {
	if path == "" {
		return f()
	}
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open netns %s: %w", path, err)
	}
	defer unix.Close(fd)
	type result struct {
		err      error
		panicked bool
		p        any
	}
	done := make(chan result, 1)
	go func() {
		var res result
		defer func() { done <- res }()
		runtime.LockOSThread()
		orig, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			runtime.UnlockOSThread()
			res.err = fmt.Errorf("open the thread's netns: %w", err)
			return
		}
		defer unix.Close(orig)
		if err := unix.Setns(fd, unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread() // a failed setns leaves the thread where it was
			res.err = fmt.Errorf("enter netns %s: %w", path, err)
			return
		}
		defer func() {
			if p := recover(); p != nil {
				res.panicked, res.p = true, p
			}
			if err := unix.Setns(orig, unix.CLONE_NEWNET); err != nil {
				// Still locked: the thread ends with the goroutine.
				res.err = errors.Join(res.err, fmt.Errorf("leave netns %s (its thread is discarded): %w", path, err))
				return
			}
			runtime.UnlockOSThread()
		}()
		res.err = f()
	}()
	res := <-done
	if res.panicked {
		panic(res.p)
	}
	return res.err
}

// ipv6Here reports whether the calling thread's namespace has IPv6: without it
// (a kernel booted with ipv6.disable=1) rtnetlink refuses every IPv6 request.
func ipv6Here() bool {
	return unix.Access("/proc/thread-self/net/if_inet6", unix.F_OK) == nil
}
