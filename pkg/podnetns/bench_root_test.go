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

// BenchmarkLocateVsFind is one look-up of each of 110 pods' namespaces (a node's
// pod limit), side by side: by the sandbox's record (open, verify device, inode and
// cookie) and by the IP scan of the netns directory (Finder, without /proc).
func BenchmarkLocateVsFind(b *testing.B) {
	testutil.RequireRoot(b)
	const n = 110
	dir := b.TempDir()
	ips := make([]netip.Addr, n)
	recs := make(records, n)
	for i := range n {
		ips[i], _ = uniqueAddrs()
		path := bindInto(b, dir, fmt.Sprintf("cni-%03d", i), podNetns(b, false, ips[i]))
		recs[i] = podnetns.Sandbox{ID: fmt.Sprintf("sb-%03d", i), PodUID: fmt.Sprintf("uid-%03d", i), Path: path, Netns: identity(b, path)}
	}
	b.Run(fmt.Sprintf("record/%d", n), func(b *testing.B) {
		l := &podnetns.Locator{ProcDir: b.TempDir(), Records: recs}
		for b.Loop() {
			for i := range n {
				h, err := l.Locate(context.Background(), locPod(recs[i].PodUID, ips[i].String()))
				if err != nil {
					b.Fatal(err)
				}
				h.Close()
			}
		}
	})
	b.Run(fmt.Sprintf("ipscan/%d", n), func(b *testing.B) {
		f := &podnetns.Finder{NetnsDirs: []string{dir}, ProcDir: "-"}
		for b.Loop() {
			for i := range n {
				h, err := f.Find(context.Background(), []netip.Addr{ips[i]})
				if err != nil {
					b.Fatal(err)
				}
				h.Close()
			}
		}
	})
}
