package sockmap_test

import (
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/meshcni/meshcni/internal/standin/proxysim"
	"github.com/meshcni/meshcni/internal/testkit/traffic"
	"github.com/meshcni/meshcni/pkg/ebpf/sockmap"
)

// dialFrom connects from a fixed local address inside ns.
func dialFrom(t testing.TB, ns string, src, dst netip.AddrPort) *net.TCPConn {
	t.Helper()
	var c net.Conn
	err := traffic.InNetns(ns, func() (err error) {
		d := net.Dialer{Timeout: 5 * time.Second, LocalAddr: net.TCPAddrFromAddrPort(src)}
		c, err = d.Dial("tcp", dst.String())
		return err
	})
	if err != nil {
		t.Fatalf("dial %v → %v in %s: %v", src, dst, ns, err)
	}
	t.Cleanup(func() { c.Close() })
	return c.(*net.TCPConn)
}

// TestSameFourTupleInTwoPods: two opted-in pods with the same addresses open
// connections with the same 4-tuple at the same time (app → peer, redirected to
// the proxy, so the app's and the proxy's sockets of both pods pair-wise share
// their 4-tuples); each gets exactly its own bytes back, and both are accelerated.
func TestSameFourTupleInTwoPods(t *testing.T) {
	a, _ := load(t)
	pods := []*pod{newPod(t), newPod(t)}
	for _, p := range pods {
		if err := a.Enable(cookie(t, p.NetNS), sockmap.Pod{ProxyUID: traffic.ProxyUID, ToApp: true}); err != nil {
			t.Fatal(err)
		}
	}
	for _, fam := range []struct {
		src, dst netip.AddrPort
	}{
		{netip.AddrPortFrom(traffic.PodIPv4, 40000), peer4},
		{netip.AddrPortFrom(traffic.PodIPv6, 40001), peer6},
	} {
		before := stats(t, a)
		var wg sync.WaitGroup
		for i, p := range pods {
			c := dialFrom(t, p.NetNS, fam.src, fam.dst)
			if got := c.LocalAddr().String(); got != fam.src.String() {
				t.Fatalf("pod %d: local address %s, want %v", i, got, fam.src)
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				roundTrip(t, c, 4<<20) // distinct random bytes per pod, checked byte-exact
			}()
		}
		wg.Wait()
		after := stats(t, a)
		if after.Bytes-before.Bytes < 2*2*4<<20 {
			t.Errorf("%v: want both pods' hops accelerated (≥ 16 MiB redirected), got %d bytes", fam.dst, after.Bytes-before.Bytes)
		}
		for _, p := range pods {
			p.proxy.WaitRecord(t, 5*time.Second, func(r proxysim.Record) bool { return r.OrigDst == fam.dst && r.Peer == fam.src })
		}
	}
}

// TestOthersUntouched: with the programs loaded and one pod opted in, a meshed pod
// that did not opt in and the host's own loopback carry their bytes through TCP
// as before: nothing of theirs is recorded or redirected, and their TCP segment
// counters grow by at least what the bytes need.
func TestOthersUntouched(t *testing.T) {
	a, _ := load(t)
	in, out := newPod(t), newPod(t)
	if err := a.Enable(cookie(t, in.NetNS), sockmap.Pod{ProxyUID: traffic.ProxyUID, ToApp: true}); err != nil {
		t.Fatal(err)
	}
	const n = 1 << 20
	// A 64 KiB segment at most per transmit: app → proxy, proxy → peer and back.
	const minSegs = 4 * n / (64 << 10)

	before, segs0 := stats(t, a), outSegs(t, out.NetNS)
	roundTrip(t, dial(t, out.NetNS, peer4), n)
	after, segs1 := stats(t, a), outSegs(t, out.NetNS)
	if after.Recorded != before.Recorded || after.Messages != before.Messages {
		t.Errorf("pod not opted in: recorded %d sockets, redirected %d messages; want none", after.Recorded-before.Recorded, after.Messages-before.Messages)
	}
	if segs1-segs0 < minSegs {
		t.Errorf("pod not opted in: TCP OutSegs grew by %d, want ≥ %d (its bytes through TCP)", segs1-segs0, minSegs)
	}

	host := hostEcho(t)
	before, segs0 = stats(t, a), outSegs(t, "")
	c, err := net.DialTimeout("tcp", host.String(), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	roundTrip(t, c.(*net.TCPConn), n)
	after, segs1 = stats(t, a), outSegs(t, "")
	if after.Recorded != before.Recorded || after.Messages != before.Messages {
		t.Errorf("host: recorded %d sockets, redirected %d messages; want none", after.Recorded-before.Recorded, after.Messages-before.Messages)
	}
	if segs1-segs0 < 2*n/(64<<10) {
		t.Errorf("host: TCP OutSegs grew by %d, want ≥ %d", segs1-segs0, 2*n/(64<<10))
	}

	// The opted-in pod, same transfer: accelerated.
	before = stats(t, a)
	roundTrip(t, dial(t, in.NetNS, peer4), n)
	if after = stats(t, a); after.Bytes-before.Bytes < 2*n {
		t.Errorf("opted-in pod: %d bytes redirected, want ≥ %d", after.Bytes-before.Bytes, 2*n)
	}
}

// hostEcho serves an echo on the host's loopback.
func hostEcho(t testing.TB) netip.AddrPort {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go serveEcho(ln)
	return ln.Addr().(*net.TCPAddr).AddrPort()
}

// outSegs reads Tcp OutSegs of the namespace at ns ("" = this process's).
func outSegs(t testing.TB, ns string) uint64 {
	t.Helper()
	var v uint64
	err := traffic.InNetns(ns, func() error {
		b, err := os.ReadFile("/proc/thread-self/net/snmp")
		if err != nil {
			return err
		}
		var names []string
		for _, line := range strings.Split(string(b), "\n") {
			f := strings.Fields(line)
			if len(f) == 0 || f[0] != "Tcp:" {
				continue
			}
			if names == nil {
				names = f
				continue
			}
			for i, name := range names {
				if name == "OutSegs" {
					v, err = strconv.ParseUint(f[i], 10, 64)
					return err
				}
			}
		}
		return os.ErrNotExist
	})
	if err != nil {
		t.Fatalf("Tcp OutSegs: %v", err)
	}
	return v
}
