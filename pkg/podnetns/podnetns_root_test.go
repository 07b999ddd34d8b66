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
	"sync"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/internal/testkit/traffic"
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
			defer got.Close()
			if got.Path != want || !sameNS(t, got.NetnsPath(), target) {
				t.Fatalf("Find(%v) = %s (%s), want %s", tc.ips, got.Path, got.NetnsPath(), want)
			}
		})
	}
	t.Run("default dirs include /run/netns", func(t *testing.T) {
		h, err := (&podnetns.Finder{ProcDir: "-"}).Find(context.Background(), []netip.Addr{v4})
		if err != nil {
			t.Fatal(err)
		}
		defer h.Close()
		got := h.Path
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
	h, err := f.Find(context.Background(), []netip.Addr{v4})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	got := h.Path
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
				t.Fatalf("Find(%v) = %+v, %v; want ErrNotFound", tc.ip, got, err)
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
				if err != nil || got.Path != tc.want {
					t.Fatalf("FindPod = %+v, %v; want %q", got, err, tc.want)
				}
				got.Close()
				return
			}
			if err == nil || (tc.wantErr != nil && !errors.Is(err, tc.wantErr)) || !strings.Contains(err.Error(), tc.errText) {
				t.Fatalf("FindPod = %+v, %v; want an error %v containing %q", got, err, tc.wantErr, tc.errText)
			}
		})
	}
}

// openFds counts this process's open file descriptors.
func openFds(t *testing.T) int {
	t.Helper()
	es, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(es)
}

// TestFindAmbiguous: two distinct namespaces holding the pod's addresses are refused
// (the fault: the first one found was "repaired" while the pod stayed broken), unless
// exactly one holds all of them; one namespace reached through several paths (bind
// mounts, a process's /proc/PID/ns/net) is one candidate, named by the runtime's file.
func TestFindAmbiguous(t *testing.T) {
	testutil.RequireRoot(t)
	sleep := testutil.RequireBinary(t, "sleep")
	v4, v6 := uniqueAddrs()
	dual := []netip.Addr{v4, v6}
	dir := t.TempDir()
	// Each namespace in its own directory: a case picks the directories it scans.
	put := func(name string, addrs ...netip.Addr) (string, string) {
		d := filepath.Join(dir, name)
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
		ns := podNetns(t, false, addrs...)
		return d, bindInto(t, d, "cni-"+name, ns)
	}
	bothDir, both := put("both", v4, v6)
	bothToo, bothTooPath := put("both-too", v4, v6)
	v4Dir, only4 := put("v4only", v4)
	v6Dir, only6 := put("v6only", v6)
	// A namespace reachable only through a process (no runtime file of it scanned).
	procOnly := podNetns(t, false, v4, v6)
	cmd := exec.Command(sleep, "60")
	done, err := traffic.StartInNetns(procOnly, traffic.Root, cmd)
	if err != nil {
		t.Fatal(err)
	}
	stopProcOnly := sync.OnceFunc(func() { _ = cmd.Process.Kill(); <-done })
	t.Cleanup(stopProcOnly)
	// "both" again, through a second bind mount and a process of its own.
	bind2Dir := filepath.Join(dir, "both-again")
	if err := os.Mkdir(bind2Dir, 0o755); err != nil {
		t.Fatal(err)
	}
	bindInto(t, bind2Dir, "other-name", both)
	cmd2 := exec.Command(sleep, "60")
	done2, err := traffic.StartInNetns(both, traffic.Root, cmd2)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd2.Process.Kill(); <-done2 })

	for _, tc := range []struct {
		name string
		dirs []string
		proc string
		ips  []netip.Addr
		want string   // the path found; "" = ambiguous
		cand []string // the candidates the ambiguity error names
	}{
		{"two hold the address", []string{v4Dir, bothDir}, "-", []netip.Addr{v4}, "", []string{only4, both}},
		{"two hold all addresses", []string{bothDir, bothToo}, "-", dual, "", []string{both, bothTooPath}},
		{"each holds a part", []string{v4Dir, v6Dir}, "-", dual, "", []string{only4, only6}},
		{"a process's namespace counts", []string{bothDir}, "", dual, "", []string{both, fmt.Sprintf("/proc/%d/ns/net", cmd.Process.Pid)}},
		{"all addresses beat a part", []string{v4Dir, bothDir, v6Dir}, "-", dual, both, nil},
		{"one namespace, several paths", []string{bothDir, bind2Dir}, "-", dual, both, nil},
		{"its runtime file is named, not another path", []string{bind2Dir, bothDir}, "-", dual, filepath.Join(bind2Dir, "other-name"), nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fds := openFds(t)
			h, err := (&podnetns.Finder{NetnsDirs: tc.dirs, ProcDir: tc.proc}).Find(context.Background(), tc.ips)
			if tc.want != "" {
				if err != nil {
					t.Fatalf("Find(%v): %v", tc.ips, err)
				}
				if h.Path != tc.want || !sameNS(t, h.NetnsPath(), tc.want) {
					t.Fatalf("Find(%v) = %s, want %s", tc.ips, h.Path, tc.want)
				}
				if err := h.Close(); err != nil {
					t.Fatal(err)
				}
			} else {
				if !errors.Is(err, podnetns.ErrAmbiguous) {
					t.Fatalf("Find(%v) = %+v, %v; want ErrAmbiguous", tc.ips, h, err)
				}
				for _, c := range tc.cand {
					if !strings.Contains(err.Error(), c+" holds ") {
						t.Errorf("error %q does not name candidate %s", err, c)
					}
				}
			}
			if n := openFds(t); n != fds {
				t.Fatalf("%d fds open after Find, %d before: a candidate was not closed", n, fds)
			}
		})
	}

	// Without the process-only namespace: "both" is reached through its file and
	// through a process of its own, and named by its file.
	stopProcOnly()
	h, err := (&podnetns.Finder{NetnsDirs: []string{bothDir}}).Find(context.Background(), dual)
	if err != nil {
		t.Fatalf("file and process of one namespace: %v", err)
	}
	defer h.Close()
	if h.Path != both {
		t.Fatalf("found through %s, want the runtime's file %s (process %d holds it too)", h.Path, both, cmd2.Process.Pid)
	}
}

// TestHandleHoldsTheNamespace: what the handle enters is the namespace that was
// verified, even when the path it was found through leads elsewhere afterwards (a
// PID reused, a netns file replaced).
func TestHandleHoldsTheNamespace(t *testing.T) {
	testutil.RequireRoot(t)
	v4, _ := uniqueAddrs()
	other4, _ := uniqueAddrs()
	pod := podNetns(t, false, v4)
	intruder := podNetns(t, false, other4)
	dir := t.TempDir()
	p := bindInto(t, dir, "cni-pod", pod)
	h, err := (&podnetns.Finder{NetnsDirs: []string{dir}, ProcDir: "-"}).Find(context.Background(), []netip.Addr{v4})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	// The path now leads to another namespace.
	if err := unix.Unmount(p, unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	bindInto(t, dir, "cni-pod", intruder)
	if !sameNS(t, h.Path, intruder) {
		t.Fatal("set-up: the path should lead to the intruder now")
	}
	var found bool
	err = netnsutil.Do(h.NetnsPath(), func() error {
		addrs, err := netlink.AddrList(nil, netlink.FAMILY_V4)
		for _, a := range addrs {
			found = found || a.IP.Equal(v4.AsSlice())
		}
		return err
	})
	if err != nil || !found || !sameNS(t, h.NetnsPath(), pod) {
		t.Fatalf("entering %s (err %v): pod's address found %v; want the pod's namespace", h.NetnsPath(), err, found)
	}
	if h.Inode() == 0 {
		t.Fatal("no inode")
	}
	if err := h.Close(); err != nil {
		t.Fatal(err)
	}
	if err := h.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

func TestOpen(t *testing.T) {
	h, err := podnetns.Open("/proc/thread-self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if !sameNS(t, h.NetnsPath(), "/proc/thread-self/ns/net") {
		t.Fatal("NetnsPath leads elsewhere")
	}
	for _, p := range []string{"/proc/self/ns/mnt", t.TempDir(), "/etc/hostname", filepath.Join(t.TempDir(), "missing")} {
		if h, err := podnetns.Open(p); err == nil {
			h.Close()
			t.Errorf("Open(%s): no error, want one (not a network namespace)", p)
		}
	}
}
