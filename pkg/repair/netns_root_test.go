package repair

// The in-place repair with the real finder (pkg/podnetns) over real network
// namespaces: two namespaces holding the pod's address are refused, neither written;
// the namespace written is the one found, through its open handle.

import (
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes/fake"

	itestutil "github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/netnsutil"
	"github.com/meshcni/meshcni/pkg/podnetns"
)

// nsWith makes a netns holding addrs on eth0 (a veth pair with both ends inside) and
// bind-mounts it at dir/name, as a runtime does; it returns that path.
func nsWith(t *testing.T, dir, name string, addrs ...netip.Addr) string {
	t.Helper()
	src := itestutil.NewNetns(t)
	err := netnsutil.Do(src, func() error {
		link := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "eth0"}, PeerName: "peer0"}
		if err := netlink.LinkAdd(link); err != nil {
			return fmt.Errorf("add veth: %w", err)
		}
		if err := netlink.LinkSetUp(link); err != nil {
			return err
		}
		for _, a := range addrs {
			bits := a.BitLen()
			addr := &netlink.Addr{IPNet: &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(bits, bits)}, Flags: unix.IFA_F_NODAD}
			if err := netlink.AddrAdd(link, addr); err != nil {
				return fmt.Errorf("add %v: %w", a, err)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("set up netns %s: %v", src, err)
	}
	dst := filepath.Join(dir, name)
	if err := os.WriteFile(dst, nil, 0o444); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(src, dst, "none", unix.MS_BIND, ""); err != nil {
		t.Fatalf("bind %s at %s: %v", src, dst, err)
	}
	t.Cleanup(func() { _ = unix.Unmount(dst, unix.MNT_DETACH) })
	return dst
}

// podAddrs are addresses no other test on the machine holds (benchmarking and
// documentation ranges, random).
func podAddrs() (netip.Addr, netip.Addr) {
	r := rand.Uint32()
	v4 := netip.AddrFrom4([4]byte{198, 18 + byte(r>>24)&1, byte(r >> 16), byte(r>>8)&0xfe | 2})
	v6 := netip.MustParseAddr(fmt.Sprintf("2001:db8:%x:%x::%x", r>>16, r&0xffff, rand.Uint32N(0xfffe)+1))
	return v4, v6
}

func TestControllerRefusesAmbiguousNetns(t *testing.T) {
	itestutil.RequireRoot(t)
	v4, _ := podAddrs()
	dir := t.TempDir()
	victim := nsWith(t, dir, "cni-victim", v4)
	other := nsWith(t, dir, "cni-other", v4) // a stale namespace, or a reused address
	pod := brokenPod()
	pod.Status.PodIP = v4.String()
	h := start(t, ActionRepair, func(o *Options, _ *fake.Clientset) {
		o.Netns = &podnetns.Finder{NetnsDirs: []string{dir}, ProcDir: "-"}
	}, pod)
	e := h.nextEvent(t)
	if !strings.HasPrefix(e, "Warning "+ReasonFailed+" ") || !strings.Contains(e, "several network namespaces hold the pod's addresses") ||
		!strings.Contains(e, victim) || !strings.Contains(e, other) {
		t.Fatalf("Event %q: want %s naming both %s and %s", e, ReasonFailed, victim, other)
	}
	if e := h.nextEvent(t); !strings.HasPrefix(e, "Warning "+ReasonGaveUp+" ") {
		t.Fatalf("Event %q", e)
	}
	if n := h.apply.count(); n != 0 {
		t.Fatalf("%d applies, want none: neither namespace may be written", n)
	}
	if h.count(ActionRepair, resultError) != 2 || h.count(ActionRepair, resultSuccess) != 0 {
		t.Fatal("metrics")
	}
}

func TestControllerRepairsTheNamespaceHoldingAllAddresses(t *testing.T) {
	itestutil.RequireRoot(t)
	v4, v6 := podAddrs()
	dir := t.TempDir()
	nsWith(t, dir, "a-stale", v4) // sorted first: the first found
	victim := nsWith(t, dir, "cni-victim", v4, v6)
	pod := brokenPod()
	pod.Status.PodIPs = []corev1.PodIP{{IP: v4.String()}, {IP: v6.String()}}
	h := start(t, ActionRepair, func(o *Options, _ *fake.Clientset) {
		o.Netns = &podnetns.Finder{NetnsDirs: []string{dir}, ProcDir: "-"}
	}, pod)
	if e := h.nextEvent(t); !strings.HasPrefix(e, "Normal "+ReasonRepaired+" ") || !strings.Contains(e, victim) {
		t.Fatalf("Event %q: want %s in %s", e, ReasonRepaired, victim)
	}
	if n := h.apply.count(); n != 1 || h.apply.inodes[0] != inode(victim) {
		t.Fatalf("%d applies, into netns inode %v; want 1 into %s (inode %d)", n, h.apply.inodes, victim, inode(victim))
	}
}
