package podnetns_test

import (
	"context"
	"fmt"
	"net/netip"
	"os/exec"
	"testing"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/internal/testkit/traffic"
	"github.com/meshcni/meshcni/pkg/podnetns"
)

// BenchmarkFind finds the last of n pod namespaces: in a netns directory (alone, and
// with the /proc scan every Find makes by default), and through /proc only (each
// namespace held by a sleeping process, no directory).
func BenchmarkFind(b *testing.B) {
	testutil.RequireRoot(b)
	sleep := testutil.RequireBinary(b, "sleep")
	for _, n := range []int{10, 50} {
		dir := b.TempDir()
		var last netip.Addr
		for i := range n {
			v4, _ := uniqueAddrs()
			bindInto(b, dir, fmt.Sprintf("cni-%03d", i), podNetns(b, false, v4))
			last = v4
		}
		for _, proc := range []string{"-", ""} {
			name := fmt.Sprintf("dir/%d", n)
			if proc == "" {
				name = fmt.Sprintf("dir+proc/%d", n)
			}
			b.Run(name, func(b *testing.B) {
				f := &podnetns.Finder{NetnsDirs: []string{dir}, ProcDir: proc}
				for b.Loop() {
					h, err := f.Find(context.Background(), []netip.Addr{last})
					if err != nil {
						b.Fatal(err)
					}
					h.Close()
				}
			})
		}
	}
	const n = 10
	var last netip.Addr
	for range n {
		v4, _ := uniqueAddrs()
		cmd := exec.Command(sleep, "600")
		done, err := traffic.StartInNetns(podNetns(b, false, v4), traffic.Root, cmd)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = cmd.Process.Kill(); <-done })
		last = v4
	}
	b.Run(fmt.Sprintf("proc/%d", n), func(b *testing.B) {
		f := &podnetns.Finder{NetnsDirs: []string{}}
		for b.Loop() {
			h, err := f.Find(context.Background(), []netip.Addr{last})
			if err != nil {
				b.Fatal(err)
			}
			h.Close()
		}
	})
}
