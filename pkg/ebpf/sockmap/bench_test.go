package sockmap_test

import (
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/internal/testkit/traffic"
	"github.com/meshcni/meshcni/pkg/ebpf/sockmap"
)

// BenchmarkHop measures a meshed pod's traffic through its proxy with
// acceleration off and on interleaved: every iteration runs one unit in each
// mode (rotating which goes first), so all see the same machine.
// Sub-benchmarks, each pinned (the test binary and the proxy on CPU 0) and
// unpinned: rr = 64 B request/response latency app → proxy (REDIRECT to 15001)
// → peer, 100 round trips on one connection per unit; rr-in the same peer →
// proxy (15006) → app; bulk = one 4 MiB upload app → proxy → peer per unit;
// connect = 20 connections set up, 1 B echoed and closed per unit. Metrics: the
// figures per mode (off, toproxy = Pod{}, both = Pod{ToApp: true}) and the
// ratios off/mode (>1: acceleration helps). Each sub-benchmark fails unless the
// acceleration's counters show bytes redirected in the toproxy and both arms and
// nothing recorded or seen in the off arm.
//
//	go test -run '^$' -bench Hop -benchtime 150x -count 3 ./pkg/ebpf/sockmap/
func BenchmarkHop(b *testing.B) {
	a, _ := load(b)
	p := newPod(b)
	sink := listenIn(b, p.PeerNetNS, "[::]:8082")
	go serveSink(sink)
	benchHops(b, hops{
		set:   setter(b, a, cookie(b, p.NetNS)),
		stats: func() sockmap.Stats { return stats(b, a) },
		pids:  []int{os.Getpid(), p.proxy.Cmd.Process.Pid},
		app:   p.NetNS, peer: p.PeerNetNS,
		out: peer4, in: pod4, sink: withPort(peer4, 8082),
	})
	s, err := a.Stats()
	if err == nil {
		b.Logf("stats: %+v", s)
	}
}

// hops is where benchHops measures: the app's and the peer's network namespaces,
// the peer's echo (out) and sink, reached from the app through its proxy, and the
// app's echo (in), reached from the peer through the proxy.
type hops struct {
	set           func(mode int)       // puts the app's netns in a mode
	stats         func() sockmap.Stats // the acceleration's counters
	pids          []int                // processes pinned to CPU 0 in the pinned runs
	app, peer     string
	out, in, sink netip.AddrPort
}

// setter returns the function that puts the netns with this cookie in a mode.
func setter(b *testing.B, a *sockmap.Accel, ck uint64) func(mode int) {
	return func(mode int) {
		var err error
		switch mode {
		case off:
			err = a.Disable(ck)
		case toProxy:
			err = a.Enable(ck, sockmap.Pod{ProxyUID: traffic.ProxyUID})
		case both:
			err = a.Enable(ck, sockmap.Pod{ProxyUID: traffic.ProxyUID, ToApp: true})
		}
		if err != nil {
			b.Fatal(err)
		}
	}
}

// benchHops runs the sub-benchmarks rr, rr-in, bulk and connect, pinned and
// unpinned, each interleaving the modes.
func benchHops(b *testing.B, h hops) {
	for _, cpu := range []string{"pinned", "unpinned"} {
		pin := func(b *testing.B) {
			if err := setAffinity(h.pids, cpu == "pinned"); err != nil {
				b.Fatalf("affinity: %v", err)
			}
			b.Cleanup(func() { _ = setAffinity(h.pids, false) })
		}
		for _, dir := range []struct {
			name, from string
			dst        netip.AddrPort
		}{
			{"rr", h.app, h.out}, {"rr-in", h.peer, h.in},
		} {
			b.Run(dir.name+"/"+cpu, func(b *testing.B) {
				pin(b)
				var lat [modes][]time.Duration
				interleave(b, h, func(m int) { lat[m] = append(lat[m], rrUnit(b, dir.from, dir.dst, 100)...) })
				reportLatency(b, lat)
			})
		}
		b.Run("bulk/"+cpu, func(b *testing.B) {
			pin(b)
			var dur [modes]time.Duration
			const size = 4 << 20
			interleave(b, h, func(m int) { dur[m] += bulkUnit(b, h.app, h.sink, size) })
			report(b, dur, float64(size*b.N)/1e6, "MB/s")
		})
		b.Run("connect/"+cpu, func(b *testing.B) {
			pin(b)
			var dur [modes]time.Duration
			const conns = 20
			interleave(b, h, func(m int) { dur[m] += connectUnit(b, h.app, h.out, conns) })
			report(b, dur, float64(conns*b.N), "conn/s")
		})
	}
}

// The modes compared: acceleration off, to the proxy only (Pod{}), both ways
// (Pod{ToApp: true}).
const (
	off = iota
	toProxy
	both
	modes
)

var modeNames = [modes]string{"off", "toproxy", "both"}

// interleave runs unit once in each mode, b.N times, rotating the order, and then
// checks each mode against the acceleration's counters (checkModes).
func interleave(b *testing.B, h hops, unit func(mode int)) {
	var moved [modes]sockmap.Stats
	b.ResetTimer()
	for i := range b.N {
		for j := range modes {
			m := (i + j) % modes
			h.set(m)
			b.StopTimer()
			before := h.stats()
			b.StartTimer()
			unit(m)
			b.StopTimer()
			moved[m] = addStats(moved[m], subStats(h.stats(), before))
			b.StartTimer()
		}
	}
	b.StopTimer()
	checkModes(b, moved)
}

// checkModes fails the benchmark unless each arm measured what it is named after:
// with acceleration on (toproxy, both) the counters show messages and bytes
// redirected during its units; with it off, no socket recorded, no message seen.
func checkModes(b *testing.B, moved [modes]sockmap.Stats) {
	b.Helper()
	for _, m := range []int{toProxy, both} {
		if moved[m].Messages == 0 || moved[m].Bytes == 0 {
			b.Errorf("arm %s: acceleration on, yet nothing redirected during its units (counters moved by %+v): it measured plain TCP", modeNames[m], moved[m])
		}
	}
	if s := moved[off]; s.Recorded != 0 || s.Messages != 0 || s.Bytes != 0 || s.Misses != 0 {
		b.Errorf("arm off: acceleration off, yet the counters moved by %+v during its units, want no socket recorded and no message seen", s)
	}
}

// subStats is the counters' movement from before to after (Sockets: the sockets in
// the sockhash at the end).
func subStats(after, before sockmap.Stats) sockmap.Stats {
	return sockmap.Stats{
		Sockets: after.Sockets, Recorded: after.Recorded - before.Recorded, Collisions: after.Collisions - before.Collisions,
		Messages: after.Messages - before.Messages, Bytes: after.Bytes - before.Bytes, Misses: after.Misses - before.Misses,
	}
}

func addStats(a, d sockmap.Stats) sockmap.Stats {
	return sockmap.Stats{
		Sockets: d.Sockets, Recorded: a.Recorded + d.Recorded, Collisions: a.Collisions + d.Collisions,
		Messages: a.Messages + d.Messages, Bytes: a.Bytes + d.Bytes, Misses: a.Misses + d.Misses,
	}
}

// report reports amount/time per mode and the time ratios off/mode.
func report(b *testing.B, dur [modes]time.Duration, amount float64, unit string) {
	for m := range modes {
		b.ReportMetric(amount/dur[m].Seconds(), unit+"-"+modeNames[m])
	}
	for _, m := range []int{toProxy, both} {
		b.ReportMetric(dur[off].Seconds()/dur[m].Seconds(), "off/"+modeNames[m])
	}
}

// reportLatency reports p50 and p99 per mode and the ratios off/mode.
func reportLatency(b *testing.B, lat [modes][]time.Duration) {
	for m := range modes {
		slices.Sort(lat[m])
		b.ReportMetric(float64(pct(lat[m], 50))/1e3, "p50-"+modeNames[m]+"-µs")
		b.ReportMetric(float64(pct(lat[m], 99))/1e3, "p99-"+modeNames[m]+"-µs")
	}
	for _, m := range []int{toProxy, both} {
		b.ReportMetric(float64(pct(lat[off], 50))/float64(pct(lat[m], 50)), "p50-off/"+modeNames[m])
		b.ReportMetric(float64(pct(lat[off], 99))/float64(pct(lat[m], 99)), "p99-off/"+modeNames[m])
	}
}

func rrUnit(b *testing.B, from string, dst netip.AddrPort, n int) []time.Duration {
	c := dial(b, from, dst)
	defer c.Close()
	_ = c.SetNoDelay(true)
	msg, got := make([]byte, 64), make([]byte, 64)
	lat := make([]time.Duration, 0, n)
	for range n {
		start := time.Now()
		if _, err := c.Write(msg); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(c, got); err != nil {
			b.Fatal(err)
		}
		lat = append(lat, time.Since(start))
	}
	return lat
}

// bulkUnit uploads size bytes from ns to the sink and waits until it has read
// them all (its EOF comes back after the app's).
func bulkUnit(b *testing.B, ns string, sink netip.AddrPort, size int) time.Duration {
	c := dial(b, ns, sink)
	defer c.Close()
	buf := make([]byte, 64<<10)
	start := time.Now()
	for sent := 0; sent < size; sent += len(buf) {
		if _, err := c.Write(buf); err != nil {
			b.Fatal(err)
		}
	}
	_ = c.CloseWrite()
	if _, err := io.ReadAll(c); err != nil {
		b.Fatal(err)
	}
	return time.Since(start)
}

func connectUnit(b *testing.B, ns string, dst netip.AddrPort, n int) time.Duration {
	one := make([]byte, 1)
	start := time.Now()
	for range n {
		c := dial(b, ns, dst)
		if _, err := c.Write(one); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(c, one); err != nil {
			b.Fatal(err)
		}
		c.Close()
	}
	return time.Since(start)
}

func serveSink(ln net.Listener) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			_, _ = io.Copy(io.Discard, c)
		}()
	}
}

func pct(sorted []time.Duration, p int) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	return sorted[min(len(sorted)-1, len(sorted)*p/100)]
}

// setAffinity puts every thread of the processes on CPU 0 (pinned) or on all
// CPUs; threads created later inherit it from their creator.
func setAffinity(pids []int, pinned bool) error {
	var set unix.CPUSet
	if pinned {
		set.Set(0)
	} else {
		for i := range runtime.NumCPU() {
			set.Set(i)
		}
	}
	for _, pid := range pids {
		tasks, err := os.ReadDir(filepath.Join("/proc", strconv.Itoa(pid), "task"))
		if err != nil {
			return err
		}
		for _, t := range tasks {
			tid, _ := strconv.Atoi(t.Name())
			if err := unix.SchedSetaffinity(tid, &set); err != nil && err != unix.ESRCH {
				return fmt.Errorf("task %d: %w", tid, err)
			}
		}
	}
	return nil
}
