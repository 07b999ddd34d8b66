package audit_test

// 110 meshed pods (the kubelet's default maximum per node) in scratch namespaces:
// 1000 rounds with pods deleted during a round and namespaces vanishing mid-check,
// without an error storm and without goroutine or fd growth; and the round's cost.

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"runtime"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"

	itestutil "github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/audit"
	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/capture/k8spod"
	"github.com/meshcni/meshcni/pkg/engine"
)

const nodePods = 110

// fleet is n meshed pods, each in its own scratch namespace with its redirect.
type fleet struct {
	pods  *pods
	netns *netnsByName
	paths []string
	list  []*corev1.Pod
}

func newFleet(tb testing.TB, n int, kind backend.Kind) *fleet {
	tb.Helper()
	f := &fleet{pods: &pods{}, netns: &netnsByName{paths: map[string]string{}}}
	for i := range n {
		ip := netip.AddrFrom4([4]byte{10, 251, byte(i / 250), byte(i%250 + 2)})
		pod := meshedPod(fmt.Sprintf("pod-%03d", i), ip.String(), nil)
		path := itestutil.NewNetns(tb)
		res, err := capture.Config{}.ForPod(k8spod.From(pod), []netip.Addr{ip})
		if err != nil {
			tb.Fatal(err)
		}
		if _, err := engine.Apply(context.Background(), engine.Options{Backend: kind, NetnsPath: path}, res.Spec); err != nil {
			tb.Fatalf("apply in %s: %v", path, err)
		}
		f.netns.paths[pod.Name] = path
		f.paths = append(f.paths, path)
		f.list = append(f.list, pod)
	}
	f.pods.set(f.list...)
	return f
}

func openFDs(tb testing.TB) int {
	es, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		tb.Fatal(err)
	}
	return len(es)
}

func TestThousandRounds(t *testing.T) {
	itestutil.RequireRoot(t)
	if testing.Short() {
		t.Skip("1000 rounds over 110 namespaces: not in -short")
	}
	ctx := context.Background()
	f := newFleet(t, nodePods, backend.Nftables)
	a, rec, m := newAuditor(t, f.pods, f.netns, nil)
	if st := a.Round(ctx); st[audit.Clean] != nodePods {
		t.Fatalf("first round: %v", st)
	}
	runtime.GC()
	g0, fd0 := runtime.NumGoroutine(), openFDs(t)
	const rounds, vanishAt, deleteAt = 1000, 100, 200
	total := audit.Stats{}
	foundAfter := 0
	for i := range rounds {
		var wg sync.WaitGroup
		switch i {
		case vanishAt: // pods 0-9: the namespace vanishes while the round runs
			wg.Add(1)
			go func() {
				defer wg.Done()
				for _, p := range f.paths[:10] {
					if err := itestutil.DeleteNetns(p); err != nil {
						t.Error(err)
					}
				}
			}()
		case deleteAt: // pods 10-19: deleted from the API while the round runs
			wg.Add(1)
			go func() {
				defer wg.Done()
				time.Sleep(time.Millisecond)
				f.pods.set(f.list[20:]...)
				for _, p := range f.list[10:20] {
					a.Forget(p)
				}
			}()
		}
		for r, n := range a.Round(ctx) {
			total[r] += n
		}
		wg.Wait()
		if i == deleteAt+1 {
			foundAfter = f.netns.found()
		}
	}
	runtime.GC()
	g1, fd1 := runtime.NumGoroutine(), openFDs(t)
	t.Logf("%d rounds: %v; goroutines %d → %d, fds %d → %d, namespaces found %d times, tracked %d",
		rounds, total, g0, g1, fd0, fd1, f.netns.found(), a.Tracked())
	if g1 > g0+2 || fd1 > fd0 {
		t.Errorf("growth over %d rounds: goroutines %d → %d, fds %d → %d", rounds, g0, g1, fd0, fd1)
	}
	if total[audit.Gone] != 10 {
		t.Errorf("%d pods dropped as gone, want the 10 whose namespace vanished, once each", total[audit.Gone])
	}
	if total[audit.Failed] != 0 || total[audit.Repaired] != 0 {
		t.Errorf("failed %d, repaired %d: want none", total[audit.Failed], total[audit.Repaired])
	}
	// One namespace entry per pod per round: each found once at the start, once more
	// for each vanished one (not found) and at most once for each pod deleted during
	// its round; never again after those rounds.
	if n := f.netns.found(); n > nodePods+20 || n != foundAfter {
		t.Errorf("namespaces looked up %d times (%d after round %d), want at most %d, none after", n, foundAfter, deleteAt+1, nodePods+20)
	}
	if n := a.Tracked(); n > nodePods-20 {
		t.Errorf("%d pods tracked, want at most the %d left", n, nodePods-20)
	}
	if evs := events(rec); len(evs) != 0 {
		t.Errorf("events %q: want none", evs)
	}
	for _, stage := range []string{"spec", "netns", "check", "action"} {
		if n := int(testutilToFloat(m, stage)); n != 0 {
			t.Errorf("%d errors at stage %s", n, stage)
		}
	}
}

// BenchmarkRound110 is one audit round over 110 meshed pods (nftables, concurrency
// 4): wall time per round (ns/op) and the process's CPU time per round.
func BenchmarkRound110(b *testing.B) {
	itestutil.RequireRoot(b)
	for _, kind := range []backend.Kind{backend.Nftables, backend.IptablesNft, backend.IptablesLegacy} {
		b.Run(string(kind), func(b *testing.B) {
			ctx := context.Background()
			f := newFleet(b, nodePods, kind)
			a, _, _ := newAuditor(b, f.pods, f.netns, nil)
			a.Round(ctx)
			cpu0 := cpuTime()
			b.ResetTimer()
			for b.Loop() {
				if st := a.Round(ctx); st[audit.Clean] != nodePods {
					b.Fatalf("round: %v", st)
				}
			}
			b.StopTimer()
			b.ReportMetric(float64((cpuTime()-cpu0).Milliseconds())/float64(b.N), "cpu-ms/round")
		})
	}
}

// cpuTime is the process's user + system CPU time (children included: the
// iptables backends exec their *-save).
func cpuTime() time.Duration {
	var self, kids unix.Rusage
	_ = unix.Getrusage(unix.RUSAGE_SELF, &self)
	_ = unix.Getrusage(unix.RUSAGE_CHILDREN, &kids)
	d := func(r unix.Rusage) time.Duration {
		return time.Duration(r.Utime.Nano() + r.Stime.Nano())
	}
	return d(self) + d(kids)
}
