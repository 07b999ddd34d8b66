package engine_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/engine"
	"github.com/meshcni/meshcni/pkg/spec"
)

// BenchmarkApply measures engine.Apply of the default sidecar ruleset (IPv4+IPv6)
// into a fresh network namespace per iteration, per backend; namespace creation
// is outside the timed region.
func BenchmarkApply(b *testing.B) {
	testutil.RequireRoot(b)
	s := spec.PodDefaults()
	s.EnableIPv6 = true
	kinds := []backend.Kind{backend.IptablesLegacy, backend.IptablesNft}
	if _, err := engine.New(backend.Nftables); err == nil {
		kinds = append(kinds, backend.Nftables)
	}
	for _, k := range kinds {
		b.Run(string(k), func(b *testing.B) {
			for i := 0; b.Loop(); i++ {
				b.StopTimer()
				path, err := testutil.CreateNetns(fmt.Sprintf("mcni-bench-%d", i))
				if err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
				if _, err := engine.Apply(context.Background(), engine.Options{Backend: k, NetnsPath: path}, &s); err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				if err := testutil.DeleteNetns(path); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
		})
	}
}

// BenchmarkPodCycle measures what the CNI plugin does per meshed pod (default
// backend choice, IPv4 REDIRECT): Apply into a fresh namespace, then Clean, each
// timed on its own (apply-ms, clean-ms). "handoff" passes the netlink sockets to a
// holder that closes them outside the timed region, as the plugin does with the node
// agent; "self-close" closes them in Clean (no agent), paying the kernel's RCU grace
// period for the deleted table.
func BenchmarkPodCycle(b *testing.B) {
	testutil.RequireRoot(b)
	s := spec.PodDefaults()
	for _, handoff := range []bool{false, true} {
		name := "self-close"
		if handoff {
			name = "handoff"
		}
		b.Run(name, func(b *testing.B) {
			var held []int
			o := engine.Options{Backend: backend.Auto}
			if handoff {
				o.HandOff = func(fds ...int) error {
					for _, fd := range fds {
						d, err := unix.Dup(fd)
						if err != nil {
							return err
						}
						held = append(held, d)
					}
					return nil
				}
			}
			var apply, clean time.Duration
			for i := 0; b.Loop(); i++ {
				b.StopTimer()
				path, err := testutil.CreateNetns(fmt.Sprintf("mcni-cycle-%d", i))
				if err != nil {
					b.Fatal(err)
				}
				o.NetnsPath = path
				b.StartTimer()
				t0 := time.Now()
				if _, err := engine.Apply(context.Background(), o, &s); err != nil {
					b.Fatal(err)
				}
				t1 := time.Now()
				if err := engine.Clean(context.Background(), o); err != nil {
					b.Fatal(err)
				}
				t2 := time.Now()
				b.StopTimer()
				apply += t1.Sub(t0)
				clean += t2.Sub(t1)
				for _, fd := range held {
					unix.Close(fd)
				}
				held = held[:0]
				if err := testutil.DeleteNetns(path); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
			b.ReportMetric(float64(apply.Microseconds())/1000/float64(b.N), "apply-ms")
			b.ReportMetric(float64(clean.Microseconds())/1000/float64(b.N), "clean-ms")
		})
	}
}
