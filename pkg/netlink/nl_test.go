package netlink

import (
	"errors"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/pkg/netlink/nltest"
)

// TestReceiveTimeout: Open sets a 5 s receive timeout on its sockets, and a
// request the other end never answers fails once the timeout passes, with an error
// wrapping os.ErrDeadlineExceeded, instead of blocking for ever.
func TestReceiveTimeout(t *testing.T) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_ROUTE)
	if err != nil {
		t.Fatal(err)
	}
	unix.Close(fd)
	s, err := Open(unix.NETLINK_ROUTE)
	if err != nil {
		t.Fatal(err)
	}
	tv, err := unix.GetsockoptTimeval(s.fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO)
	s.Close()
	if err != nil || time.Duration(tv.Nano()) != Timeout || Timeout != 5*time.Second {
		t.Fatalf("SO_RCVTIMEO of Open's socket = %v (%v), want %v", time.Duration(tv.Nano()), err, 5*time.Second)
	}

	_, cfd, port := nltest.New(t, func(nltest.Req) [][]byte { return nil }) // never answers
	c := NewConn(cfd, port)
	if err := SetRcvTimeout(c.fd, 100*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	t0 := time.Now()
	go func() { errc <- c.Dump(unix.RTM_GETRULE, make([]byte, unix.SizeofRtMsg), nil, func(uint16, []byte) {}) }()
	select {
	case err := <-errc:
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("dump without an answer = %v, want os.ErrDeadlineExceeded", err)
		}
		if d := time.Since(t0); d < 90*time.Millisecond {
			t.Fatalf("gave up after %v, before the timeout", d)
		}
	case <-time.After(3 * time.Second):
		t.Fatal("dump without an answer still waiting after 3 s")
	}
}
