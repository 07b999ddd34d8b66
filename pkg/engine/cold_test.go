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

	"github.com/meshcni/meshcni/internal/testutil"
	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/engine"
	"github.com/meshcni/meshcni/pkg/spec"
)

// coldCleanEnv names the namespace a child test binary cleans (see TestMain).
const coldCleanEnv = "MESHCNI_ENGINE_COLD_CLEAN_NETNS"

// TestMain lets BenchmarkCleanCold run Clean in a fresh process: the test binary,
// started with coldCleanEnv set, only runs coldClean.
func TestMain(m *testing.M) {
	if path := os.Getenv(coldCleanEnv); path != "" {
		os.Exit(coldClean(path))
	}
	os.Exit(m.Run())
}

// coldClean runs one engine.Clean (backend auto, sockets handed off as the plugin
// does) in this fresh process and prints its duration in nanoseconds. The handed-off
// copies stay open until the process exits, after the measurement.
func coldClean(path string) int {
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
	t0 := time.Now()
	err := engine.Clean(context.Background(), o)
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
				cmd := exec.Command(self)
				cmd.Env = append(os.Environ(), coldCleanEnv+"="+path)
				var out, errb bytes.Buffer
				cmd.Stdout, cmd.Stderr = &out, &errb
				b.StartTimer()
				err = cmd.Run()
				b.StopTimer()
				if err != nil {
					b.Fatalf("cold clean: %v: %s", err, errb.Bytes())
				}
				ns, err := strconv.ParseInt(string(bytes.TrimSpace(out.Bytes())), 10, 64)
				if err != nil {
					b.Fatalf("cold clean output %q: %v", out.Bytes(), err)
				}
				ds = append(ds, time.Duration(ns))
				if err := testutil.DeleteNetns(path); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
			var sum time.Duration
			for _, d := range ds {
				sum += d
			}
			slices.Sort(ds)
			b.ReportMetric(float64(sum.Microseconds())/1000/float64(len(ds)), "clean-ms")
			b.ReportMetric(float64(ds[len(ds)/2].Microseconds())/1000, "clean-p50-ms")
		})
	}
}
