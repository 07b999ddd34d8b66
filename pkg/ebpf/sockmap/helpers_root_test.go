package sockmap_test

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/internal/testkit/traffic"
	"github.com/meshcni/meshcni/pkg/ebpf/sockmap"
	"github.com/meshcni/meshcni/pkg/engine"
	"github.com/meshcni/meshcni/pkg/spec"
)

var pinCounter atomic.Uint64

// testOptions: a pin directory on a bpffs of the test's own; the host's cgroup2.
func testOptions(t testing.TB) sockmap.Options {
	return sockmap.Options{PinDir: fmt.Sprintf("%s/meshcni-test-%d/sockmap", testutil.BPFFS(t), pinCounter.Add(1))}
}

// load loads the acceleration for the test and unloads it (pins included) at its end.
func load(t testing.TB) (*sockmap.Accel, sockmap.Options) {
	t.Helper()
	testutil.RequireRoot(t)
	opts := testOptions(t)
	a, err := sockmap.Load(opts)
	if err != nil {
		if errors.Is(err, sockmap.ErrUnavailable) {
			testutil.Missing(t, "%v", err)
		}
		t.Fatalf("load: %v", err)
	}
	t.Cleanup(func() {
		a.Close()
		if err := sockmap.Unload(opts); err != nil {
			t.Errorf("unload: %v", err)
		}
	})
	return a, opts
}

// pod is a meshed scratch pod: meshcni's redirect applied by pkg/engine (both
// families), a forwarding stand-in proxy as UID 1337 (inbound dials from
// 127.0.0.6 / ::6), an echo server on the peer (8080) and in the pod (9090).
type pod struct {
	*traffic.Pod
	proxy *traffic.Proxy
}

var (
	peer4 = netip.AddrPortFrom(traffic.PeerIPv4, 8080)
	peer6 = netip.AddrPortFrom(traffic.PeerIPv6, 8080)
	pod4  = netip.AddrPortFrom(traffic.PodIPv4, 9090)
	pod6  = netip.AddrPortFrom(traffic.PodIPv6, 9090)
)

func newPod(t testing.TB) *pod {
	t.Helper()
	p := &pod{Pod: traffic.NewPod(t)}
	startEcho(t, p.PeerNetNS, "[::]:8080")
	startEcho(t, p.NetNS, "[::]:9090")
	s := spec.PodDefaults()
	s.EnableIPv6 = true
	if _, err := engine.Apply(context.Background(), engine.Options{NetnsPath: p.NetNS}, &s); err != nil {
		t.Fatalf("apply the redirect: %v", err)
	}
	p.proxy = startProxy(t, p.NetNS)
	return p
}

func startProxy(t testing.TB, ns string) *traffic.Proxy {
	return traffic.StartProxy(t, ns, traffic.ProxyOptions{Args: []string{
		"--mode=forward", "--no-splice", "--inbound-source=127.0.0.6", "--inbound-source-v6=::6", "--log-level=error"}})
}

func cookie(t testing.TB, ns string) uint64 {
	t.Helper()
	c, err := sockmap.NetnsCookie(ns)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// startEcho serves an echo (read, write back; no splice) in the namespace.
func startEcho(t testing.TB, ns, addr string) {
	t.Helper()
	var ln net.Listener
	if err := traffic.InNetns(ns, func() (err error) { ln, err = net.Listen("tcp", addr); return err }); err != nil {
		t.Fatalf("echo listen %s: %v", addr, err)
	}
	t.Cleanup(func() { ln.Close() })
	go serveEcho(ln)
}

func serveEcho(ln net.Listener) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			buf := make([]byte, 64<<10)
			for {
				n, err := c.Read(buf)
				if n > 0 {
					if _, werr := c.Write(buf[:n]); werr != nil {
						return
					}
				}
				if err != nil {
					_ = c.(*net.TCPConn).CloseWrite()
					return
				}
			}
		}()
	}
}

// dial connects from inside ns (an in-process socket: root, so redirected).
func dial(t testing.TB, ns string, dst netip.AddrPort) *net.TCPConn {
	t.Helper()
	var c net.Conn
	err := traffic.InNetns(ns, func() (err error) {
		c, err = net.DialTimeout("tcp", dst.String(), 5*time.Second)
		return err
	})
	if err != nil {
		t.Fatalf("dial %v in %s: %v", dst, ns, err)
	}
	t.Cleanup(func() { c.Close() })
	return c.(*net.TCPConn)
}

// roundTrip writes n random bytes, half-closes, reads everything back and checks it
// is byte-exact.
func roundTrip(t testing.TB, c *net.TCPConn, n int) {
	t.Helper()
	want := make([]byte, n)
	_, _ = rand.Read(want)
	_ = c.SetDeadline(time.Now().Add(30 * time.Second))
	errc := make(chan error, 1)
	go func() {
		_, err := c.Write(want)
		if err == nil {
			err = c.CloseWrite()
		}
		errc <- err
	}()
	got, err := io.ReadAll(c)
	if werr := <-errc; werr != nil {
		t.Fatalf("write %d bytes: %v", n, werr)
	}
	if err != nil {
		t.Fatalf("read back after %d of %d bytes: %v", len(got), n, err)
	}
	if len(got) != n || string(got) != string(want) {
		t.Fatalf("echo not byte-exact: got %d bytes, want %d (first difference at %d)", len(got), n, firstDiff(got, want))
	}
}

func firstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

func stats(t testing.TB, a *sockmap.Accel) sockmap.Stats {
	t.Helper()
	s, err := a.Stats()
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func listenIn(t testing.TB, ns, addr string) net.Listener {
	t.Helper()
	var ln net.Listener
	if err := traffic.InNetns(ns, func() (err error) { ln, err = net.Listen("tcp", addr); return err }); err != nil {
		t.Fatalf("listen %s: %v", addr, err)
	}
	t.Cleanup(func() { ln.Close() })
	return ln
}

func withPort(ap netip.AddrPort, port uint16) netip.AddrPort {
	return netip.AddrPortFrom(ap.Addr(), port)
}
