package engine_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/engine"
	"github.com/meshcni/meshcni/pkg/spec"
)

// coldCleanEnv names the namespace a child test binary cleans (see TestMain);
// coldApplyEnv one it applies the pod defaults to.
const (
	coldCleanEnv = "MESHCNI_ENGINE_COLD_CLEAN_NETNS"
	coldApplyEnv = "MESHCNI_ENGINE_COLD_APPLY_NETNS"
)

// TestMain lets BenchmarkCleanCold and BenchmarkApplyCold run the engine in a fresh
// process: the test binary, started with coldCleanEnv (coldApplyEnv) set, only runs
// coldOp.
func TestMain(m *testing.M) {
	if path := os.Getenv(coldCleanEnv); path != "" {
		os.Exit(coldOp(path, false))
	}
	if path := os.Getenv(coldApplyEnv); path != "" {
		os.Exit(coldOp(path, true))
	}
	os.Exit(m.Run())
}

// coldOp runs one engine.Clean, or engine.Apply of the pod defaults (backend auto,
// sockets handed off as the plugin does) in this fresh process and prints its
// duration in nanoseconds. The handed-off copies stay open until the process
// exits, after the measurement.
func coldOp(path string, apply bool) int {
	var held []int
	o := engine.Options{Backend: backend.Auto, NetnsPath: path, HandOff: func(fds ...int) error {
		for _, fd := range fds {
			d, err := unix.Dup(fd)
			if err != nil {
				return err
			}
			held = append(held, d)
		}
		return nil
	}}
	s := spec.PodDefaults()
	var err error
	t0 := time.Now()
	if apply {
		_, err = engine.Apply(context.Background(), o, &s)
	} else {
		err = engine.Clean(context.Background(), o)
	}
	d := time.Since(t0)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Println(d.Nanoseconds())
	return 0
}

// BenchmarkCleanCold measures engine.Clean (backend auto) as the CNI plugin's DEL
// runs it: once, in a fresh process. Per iteration the parent applies a pod's
// redirect into a fresh namespace (default IPv4 REDIRECT, or dual-stack TPROXY,
// which adds policy routing and ::6), then starts this test binary to clean it; the
// child times Clean alone. Reported: clean-ms (mean) and clean-p50-ms; ns/op is the
// whole child process and means little.
func BenchmarkCleanCold(b *testing.B) {
	testutil.RequireRoot(b)
	self, err := os.Executable()
	if err != nil {
		b.Fatal(err)
	}
	redirect := spec.PodDefaults()
	tproxy := spec.PodDefaults()
	tproxy.Mode = spec.ModeTProxy
	tproxy.EnableIPv6 = true
	for _, c := range []struct {
		name string
		s    *spec.Spec
	}{{"redirect", &redirect}, {"tproxy-v6", &tproxy}} {
		b.Run(c.name, func(b *testing.B) {
			var ds []time.Duration
			for i := 0; b.Loop(); i++ {
				b.StopTimer()
				path, err := testutil.CreateNetns(fmt.Sprintf("mcni-cold-%d-%d", os.Getpid(), i))
				if err != nil {
					b.Fatal(err)
				}
				if _, err := engine.Apply(context.Background(), engine.Options{Backend: backend.Auto, NetnsPath: path}, c.s); err != nil {
					b.Fatal(err)
				}
				ds = append(ds, runCold(b, self, coldCleanEnv, path))
				if err := testutil.DeleteNetns(path); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
			reportCold(b, ds, "clean")
		})
	}
}

// BenchmarkApplyCold measures engine.Apply (backend auto, pod defaults: IPv4
// REDIRECT) as the CNI plugin's ADD runs it: once, in a fresh process, into a fresh
// namespace. Reported: apply-ms (mean) and apply-p50-ms, timed in the child. With
// MESHCNI_BENCH_BEFORE naming another build of this test binary, every iteration
// also runs that one (order alternating), and before-apply-p50-ms and
// apply-p50-ratio (this build's p50 over the other's) compare two builds in the
// same rounds.
func BenchmarkApplyCold(b *testing.B) {
	testutil.RequireRoot(b)
	self, err := os.Executable()
	if err != nil {
		b.Fatal(err)
	}
	builds := []string{self}
	if before := os.Getenv("MESHCNI_BENCH_BEFORE"); before != "" {
		builds = append(builds, before)
	}
	ds := make([][]time.Duration, len(builds))
	for i := 0; b.Loop(); i++ {
		b.StopTimer()
		for j := range builds {
			k := (i + j) % len(builds) // alternate which build runs first
			path, err := testutil.CreateNetns(fmt.Sprintf("mcni-coldapply-%d-%d-%d", os.Getpid(), i, k))
			if err != nil {
				b.Fatal(err)
			}
			ds[k] = append(ds[k], runCold(b, builds[k], coldApplyEnv, path))
			if err := testutil.DeleteNetns(path); err != nil {
				b.Fatal(err)
			}
		}
		b.StartTimer()
	}
	if len(builds) > 1 {
		p50, before := median(ds[0]), median(ds[1])
		reportCold(b, ds[1], "before-apply")
		b.ReportMetric(float64(p50)/float64(before), "apply-p50-ratio")
	}
	reportCold(b, ds[0], "apply")
}

// median returns the median of ds (sorted in place).
func median(ds []time.Duration) time.Duration {
	slices.Sort(ds)
	return ds[len(ds)/2]
}

// runCold runs this test binary as the child that env selects, on netns, with the
// benchmark's timer running (it is stopped on return), and returns the duration the
// child measured and printed.
func runCold(b *testing.B, self, env, netns string) time.Duration {
	b.Helper()
	cmd := exec.Command(self)
	cmd.Env = append(os.Environ(), env+"="+netns)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	b.StartTimer()
	err := cmd.Run()
	b.StopTimer()
	if err != nil {
		b.Fatalf("%s child: %v: %s", env, err, errb.Bytes())
	}
	ns, err := strconv.ParseInt(string(bytes.TrimSpace(out.Bytes())), 10, 64)
	if err != nil {
		b.Fatalf("%s child output %q: %v", env, out.Bytes(), err)
	}
	return time.Duration(ns)
}

// reportCold reports the mean and median of the children's durations as
// <what>-ms and <what>-p50-ms.
func reportCold(b *testing.B, ds []time.Duration, what string) {
	var sum time.Duration
	for _, d := range ds {
		sum += d
	}
	slices.Sort(ds)
	b.ReportMetric(float64(sum.Microseconds())/1000/float64(len(ds)), what+"-ms")
	b.ReportMetric(float64(ds[len(ds)/2].Microseconds())/1000, what+"-p50-ms")
}
