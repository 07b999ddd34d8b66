package podnetns_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/internal/testutil"
	"github.com/meshcni/meshcni/internal/traffic"
	"github.com/meshcni/meshcni/pkg/netnsutil"
	"github.com/meshcni/meshcni/pkg/podnetns"
)

// uniqueAddrs returns an IPv4 address from the benchmarking range 198.18.0.0/15 and an
// IPv6 one from the documentation range, random so concurrent tests on the machine
// (other engineers' netns) never hold the same.
func uniqueAddrs() (netip.Addr, netip.Addr) {
	r := rand.Uint32()
	v4 := netip.AddrFrom4([4]byte{198, 18 + byte(r>>24)&1, byte(r >> 16), byte(r>>8)&0xfe | 2})
	v6 := netip.MustParseAddr(fmt.Sprintf("2001:db8:%x:%x::%x", r>>16, r&0xffff, rand.Uint32N(0xfffe)+1))
	return v4, v6
}

// podNetns makes a netns holding addrs on "eth0" (up), or on lo when onLo.
func podNetns(t testing.TB, onLo bool, addrs ...netip.Addr) string {
	t.Helper()
	path := testutil.NewNetns(t)
	err := netnsutil.Do(path, func() error {
		var link netlink.Link
		if onLo {
			l, err := netlink.LinkByName("lo")
			if err != nil {
				return err
			}
			link = l
		} else {
			// A veth pair with both ends inside (this kernel has no dummy links).
			link = &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "eth0"}, PeerName: "peer0"}
			if err := netlink.LinkAdd(link); err != nil {
				return fmt.Errorf("add veth: %w", err)
			}
			if err := netlink.LinkSetUp(link); err != nil {
				return err
			}
		}
		for _, a := range addrs {
			bits := 32
			if a.Is6() {
				bits = 128
			}
			addr := &netlink.Addr{IPNet: &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(bits, bits)}, Flags: unix.IFA_F_NODAD}
			if err := netlink.AddrAdd(link, addr); err != nil {
				return fmt.Errorf("add %v: %w", a, err)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("set up netns %s: %v", path, err)
	}
	return path
}

// bindInto bind-mounts the namespace file src at dir/name (as runtimes do).
func bindInto(t testing.TB, dir, name, src string) string {
	t.Helper()
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

func sameNS(t *testing.T, a, b string) bool {
	t.Helper()
	var sa, sb unix.Stat_t
	if err := unix.Stat(a, &sa); err != nil {
		t.Fatal(err)
	}
	if err := unix.Stat(b, &sb); err != nil {
		t.Fatal(err)
	}
	return sa.Dev == sb.Dev && sa.Ino == sb.Ino
}

func TestFindInDir(t *testing.T) {
	testutil.RequireRoot(t)
	v4, v6 := uniqueAddrs()
	other4, _ := uniqueAddrs()
	target := podNetns(t, false, v4, v6)
	decoy := podNetns(t, false, other4)
	dir := t.TempDir()
	// A leftover plain file (an unmounted netns) is skipped, as is a directory.
	if err := os.WriteFile(filepath.Join(dir, "a-stale"), nil, 0o444); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(dir, "b-dir"), 0o755); err != nil {
		t.Fatal(err)
	}
	bindInto(t, dir, "cni-decoy", decoy)
	want := bindInto(t, dir, "cni-target", target)
	missing := filepath.Join(t.TempDir(), "does-not-exist")

	for _, tc := range []struct {
		name string
		ips  []netip.Addr
	}{
		{"ipv4", []netip.Addr{v4}},
		{"ipv6", []netip.Addr{v6}},
		{"any of several", []netip.Addr{netip.MustParseAddr("203.0.113.254"), v6}},
		{"v4-mapped", []netip.Addr{netip.AddrFrom16(v4.As16())}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := &podnetns.Finder{NetnsDirs: []string{missing, dir}, ProcDir: "-"}
			got, err := f.Find(context.Background(), tc.ips)
			if err != nil {
				t.Fatalf("Find(%v): %v", tc.ips, err)
			}
			if got != want {
				t.Fatalf("Find(%v) = %s, want %s", tc.ips, got, want)
			}
		})
	}
	t.Run("default dirs include /run/netns", func(t *testing.T) {
		got, err := (&podnetns.Finder{ProcDir: "-"}).Find(context.Background(), []netip.Addr{v4})
		if err != nil {
			t.Fatal(err)
		}
		if !sameNS(t, got, target) || !strings.HasPrefix(got, "/var/run/netns/") && !strings.HasPrefix(got, "/run/netns/") {
			t.Fatalf("got %s, want a /run/netns path of %s", got, target)
		}
	})
}

func TestFindProcFallback(t *testing.T) {
	testutil.RequireRoot(t)
	sleep := testutil.RequireBinary(t, "sleep")
	v4, _ := uniqueAddrs()
	target := podNetns(t, false, v4)
	cmd := exec.Command(sleep, "60")
	done, err := traffic.StartInNetns(target, traffic.Root, cmd)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); <-done })

	// No dir holds it (empty dir): only the sleeping process leads to it.
	f := &podnetns.Finder{NetnsDirs: []string{t.TempDir()}}
	got, err := f.Find(context.Background(), []netip.Addr{v4})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(got, "/proc/") || !strings.HasSuffix(got, "/ns/net") || !sameNS(t, got, target) {
		t.Fatalf("got %s, want /proc/<pid>/ns/net of %s (sleep is pid %d)", got, target, cmd.Process.Pid)
	}

	// "-" turns the fallback off.
	f.ProcDir = "-"
	if _, err := f.Find(context.Background(), []netip.Addr{v4}); !errors.Is(err, podnetns.ErrNotFound) {
		t.Fatalf("without /proc: err = %v, want ErrNotFound", err)
	}
}

func hostAddr(t *testing.T) netip.Addr {
	t.Helper()
	addrs, err := netlink.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range addrs {
		l, err := netlink.LinkByIndex(a.LinkIndex)
		if err != nil || l.Attrs().Flags&net.FlagLoopback != 0 {
			continue
		}
		if ip, ok := netip.AddrFromSlice(a.IP); ok && !ip.IsLinkLocalUnicast() {
			return ip.Unmap()
		}
	}
	t.Fatal("the host has no address outside lo")
	return netip.Addr{}
}

func TestNotFound(t *testing.T) {
	testutil.RequireRoot(t)
	v4, _ := uniqueAddrs()
	onLo, _ := uniqueAddrs()
	nsPath := podNetns(t, false, v4)
	loNS := podNetns(t, true, onLo)
	dir := t.TempDir()
	// The same netns twice and the host's own netns: looked into once, host never.
	bindInto(t, dir, "one", nsPath)
	bindInto(t, dir, "two", nsPath)
	bindInto(t, dir, "lo", loNS)
	// This thread's netns, not /proc/self's: the main thread may be wedged in a
	// namespace made by an earlier test.
	runtime.LockOSThread()
	bindInto(t, dir, "host", "/proc/thread-self/ns/net")
	runtime.UnlockOSThread()
	absent, _ := uniqueAddrs()

	for _, tc := range []struct {
		name    string
		ip      netip.Addr
		proc    string
		wantMsg string
	}{
		{"absent address", absent, "-", "2 namespaces looked into"},
		{"address on lo", onLo, "-", "2 namespaces looked into"},
		{"the host's own address, dirs only", hostAddr(t), "-", "2 namespaces looked into"},
		{"the host's own address, with /proc", hostAddr(t), "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := &podnetns.Finder{NetnsDirs: []string{dir}, ProcDir: tc.proc}
			got, err := f.Find(context.Background(), []netip.Addr{tc.ip})
			if !errors.Is(err, podnetns.ErrNotFound) {
				t.Fatalf("Find(%v) = %q, %v; want ErrNotFound", tc.ip, got, err)
			}
			if !strings.Contains(err.Error(), tc.ip.String()) || !strings.Contains(err.Error(), tc.wantMsg) {
				t.Fatalf("error %q should name %v and say %q", err, tc.ip, tc.wantMsg)
			}
		})
	}
}

func TestFindErrors(t *testing.T) {
	f := &podnetns.Finder{NetnsDirs: []string{}, ProcDir: "-"}
	if _, err := f.Find(context.Background(), nil); err == nil || errors.Is(err, podnetns.ErrNotFound) {
		t.Fatalf("no IPs: err = %v, want a usage error", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if os.Geteuid() == 0 {
		f := &podnetns.Finder{NetnsDirs: []string{}}
		if _, err := f.Find(ctx, []netip.Addr{netip.MustParseAddr("203.0.113.9")}); !errors.Is(err, context.Canceled) {
			t.Fatalf("cancelled: err = %v, want context.Canceled", err)
		}
	}
}

func TestFindPod(t *testing.T) {
	testutil.RequireRoot(t)
	v4, v6 := uniqueAddrs()
	target := podNetns(t, false, v4, v6)
	dir := t.TempDir()
	want := bindInto(t, dir, "cni-pod", target)
	f := &podnetns.Finder{NetnsDirs: []string{dir}, ProcDir: "-"}
	meta := metav1.ObjectMeta{Namespace: "ns1", Name: "p1"}

	for _, tc := range []struct {
		name    string
		pod     *corev1.Pod
		want    string
		wantErr error
		errText string
	}{
		{"podIPs dual stack", &corev1.Pod{ObjectMeta: meta, Status: corev1.PodStatus{PodIPs: []corev1.PodIP{{IP: "203.0.113.77"}, {IP: v6.String()}}}}, want, nil, ""},
		{"podIP only", &corev1.Pod{ObjectMeta: meta, Status: corev1.PodStatus{PodIP: v4.String()}}, want, nil, ""},
		{"host network", &corev1.Pod{ObjectMeta: meta, Spec: corev1.PodSpec{HostNetwork: true}, Status: corev1.PodStatus{PodIP: v4.String()}}, "", podnetns.ErrHostNetwork, "ns1/p1: pod uses the host network"},
		{"no IP yet", &corev1.Pod{ObjectMeta: meta, Status: corev1.PodStatus{Phase: corev1.PodPending}}, "", podnetns.ErrNoPodIP, "ns1/p1: pod has no IP address yet (phase Pending)"},
		{"bad IP", &corev1.Pod{ObjectMeta: meta, Status: corev1.PodStatus{PodIP: "10.0.0.300"}}, "", nil, `bad IP "10.0.0.300"`},
		{"elsewhere", &corev1.Pod{ObjectMeta: meta, Status: corev1.PodStatus{PodIP: "203.0.113.78"}}, "", podnetns.ErrNotFound, "ns1/p1: network namespace not found"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			got, err := f.FindPod(ctx, tc.pod)
			if tc.want != "" {
				if err != nil || got != tc.want {
					t.Fatalf("FindPod = %q, %v; want %q", got, err, tc.want)
				}
				return
			}
			if err == nil || (tc.wantErr != nil && !errors.Is(err, tc.wantErr)) || !strings.Contains(err.Error(), tc.errText) {
				t.Fatalf("FindPod = %q, %v; want an error %v containing %q", got, err, tc.wantErr, tc.errText)
			}
		})
	}
}
