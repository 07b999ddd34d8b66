package repair

// The in-place repair with the real locator (pkg/podnetns) over real network
// namespaces: a pod whose processes run in two namespaces is refused, neither
// written; the namespace written is the one located, through its open handle; a
// stale IP held by another sandbox never leads to it.

import (
	"context"
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
	"github.com/meshcni/meshcni/internal/testkit/traffic"
	"github.com/meshcni/meshcni/pkg/engine"
	"github.com/meshcni/meshcni/pkg/netnsutil"
	"github.com/meshcni/meshcni/pkg/podnetns"
	"github.com/meshcni/meshcni/pkg/sandboxstate"
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

// sandboxes is a fixed set of recorded sandboxes (the agent's are pkg/agent's).
type sandboxes []podnetns.Sandbox

func (r sandboxes) PodSandbox(uid string) (podnetns.Sandbox, bool) {
	for _, s := range r {
		if s.PodUID == uid {
			return s, true
		}
	}
	return podnetns.Sandbox{}, false
}

func (r sandboxes) Holders(dev, ino uint64) []podnetns.Sandbox {
	var out []podnetns.Sandbox
	for _, s := range r {
		if s.Netns.Dev == dev && s.Netns.Inode == ino {
			out = append(out, s)
		}
	}
	return out
}

// recordOf is the sandbox record of a netns as the plugin reads it at ADD.
func recordOf(t *testing.T, id, uid, path string) podnetns.Sandbox {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	c, err := netnsutil.Cookie(path)
	if err != nil {
		t.Fatal(err)
	}
	return podnetns.Sandbox{ID: id, PodUID: uid, Path: path, Netns: podnetns.Identity{Dev: uint64(st.Dev), Inode: st.Ino, Cookie: c}}
}

// procWith is a proc directory whose processes run in the kubelet's cgroup of the
// pod UID, one in each netns.
func procWith(t *testing.T, uid string, netns ...string) string {
	t.Helper()
	dir := t.TempDir()
	for i, ns := range netns {
		d := filepath.Join(dir, fmt.Sprint(100+i))
		if err := os.MkdirAll(filepath.Join(d, "ns"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(d, "cgroup"), []byte("0::/kubepods/besteffort/pod"+uid+"/ctr\n"), 0o444); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(ns, filepath.Join(d, "ns", "net")); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

const unrecordedUID = "aaaaaaaa-0000-4000-8000-000000000001"

// TestControllerRefusesAmbiguousNetns: a pod without a record whose cgroup's
// processes run in two namespaces: neither is written, the refusal names both,
// once, and is not retried.
func TestControllerRefusesAmbiguousNetns(t *testing.T) {
	itestutil.RequireRoot(t)
	v4, _ := podAddrs()
	dir := t.TempDir()
	victim := nsWith(t, dir, "cni-victim", v4)
	other := nsWith(t, dir, "cni-other", v4)
	pod := brokenPod()
	pod.UID = unrecordedUID
	pod.Status.PodIP = v4.String()
	h := start(t, ActionRepair, func(o *Options, _ *fake.Clientset) {
		o.Netns = &podnetns.Locator{ProcDir: procWith(t, unrecordedUID, victim, other)}
	}, pod)
	e := h.nextEvent(t)
	if !strings.HasPrefix(e, "Warning "+ReasonRefused+" ") || !strings.Contains(e, "run in 2 network namespaces") ||
		!strings.Contains(e, fmt.Sprintf("inode %d", inode(victim))) || !strings.Contains(e, fmt.Sprintf("inode %d", inode(other))) {
		t.Fatalf("Event %q: want %s naming both namespaces' inodes", e, ReasonRefused)
	}
	h.noEvent(t)
	if n := h.apply.count(); n != 0 {
		t.Fatalf("%d applies, want none: neither namespace may be written", n)
	}
	if h.count(ActionRepair, resultRefused) != 1 || h.count(ActionRepair, resultError) != 0 || h.count(ActionRepair, resultSuccess) != 0 {
		t.Fatal("metrics: want one refusal")
	}
}

// TestControllerRepairsTheCgroupsNetns: a pod without a record is repaired in the
// namespace its cgroup's processes run in, cross-checked by its addresses, even
// when another namespace holds one of them.
func TestControllerRepairsTheCgroupsNetns(t *testing.T) {
	itestutil.RequireRoot(t)
	v4, v6 := podAddrs()
	dir := t.TempDir()
	nsWith(t, dir, "a-stale", v4)
	victim := nsWith(t, dir, "cni-victim", v4, v6)
	pod := brokenPod()
	pod.UID = unrecordedUID
	pod.Status.PodIPs = []corev1.PodIP{{IP: v4.String()}, {IP: v6.String()}}
	h := start(t, ActionRepair, func(o *Options, _ *fake.Clientset) {
		o.Netns = &podnetns.Locator{ProcDir: procWith(t, unrecordedUID, victim)}
	}, pod)
	if e := h.nextEvent(t); !strings.HasPrefix(e, "Normal "+ReasonRepaired+" ") || !strings.Contains(e, "/ns/net") {
		t.Fatalf("Event %q: want %s", e, ReasonRepaired)
	}
	if n := h.apply.count(); n != 1 || h.apply.inodes[0] != inode(victim) {
		t.Fatalf("%d applies, into netns inode %v; want 1 into %s (inode %d)", n, h.apply.inodes, victim, inode(victim))
	}
}

// TestControllerStaleIPHeldByAnotherSandbox: pod A's sandbox is gone, its status
// still carries IP X, and an unmeshed sandbox B holds X. The in-place repair
// (the real engine) leaves B untouched: no rule, its packets reach its app
// directly with a proxy listening that would catch them otherwise; A is reported,
// once; nothing is deleted.
func TestControllerStaleIPHeldByAnotherSandbox(t *testing.T) {
	itestutil.RequireRoot(t)
	dir := t.TempDir()
	b := traffic.NewPod(t)
	peer4 := netip.AddrPortFrom(traffic.PeerIPv4, 8080)
	pod4 := netip.AddrPortFrom(traffic.PodIPv4, 9090)
	traffic.StartApp(t, b.PeerNetNS, peer4, "peer-app")
	traffic.StartApp(t, b.NetNS, pod4, "pod-b-app")
	traffic.StartProxy(t, b.NetNS, traffic.ProxyOptions{})
	nsB := filepath.Join(dir, "cni-b")
	if err := os.WriteFile(nsB, nil, 0o444); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(b.NetNS, nsB, "none", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(nsB, unix.MNT_DETACH) })
	gone := itestutil.NewNetns(t)
	recA := recordOf(t, "sandbox-a", "uid-1", gone)
	if err := itestutil.DeleteNetns(gone); err != nil {
		t.Fatal(err)
	}
	pod := brokenPod() // uid-1
	pod.Status.PodIP = traffic.PodIPv4.String()
	h := start(t, ActionRepair, func(o *Options, _ *fake.Clientset) {
		o.Netns = &podnetns.Locator{ProcDir: t.TempDir(), Records: sandboxes{recA, recordOf(t, "sandbox-b", "uid-b", nsB)}}
		o.Apply = engine.Apply
	}, pod)
	e := h.nextEvent(t)
	if !strings.HasPrefix(e, "Warning "+ReasonRefused+" ") || !strings.Contains(e, "sandbox sandbox-a") || !strings.Contains(e, "gone") {
		t.Fatalf("Event %q: want %s naming A's gone sandbox", e, ReasonRefused)
	}
	h.noEvent(t)
	live, err := engine.Live(context.Background(), engine.Options{NetnsPath: b.NetNS})
	if err != nil {
		t.Fatal(err)
	}
	for k, txt := range live {
		if strings.TrimSpace(txt) != "" {
			t.Errorf("B's netns holds %s rules:\n%s", k, txt)
		}
	}
	ans := traffic.Dial(t, b.PeerNetNS, pod4, traffic.DialOptions{Cred: traffic.Cred{UID: 1000, GID: 1000}})
	if ans.App == nil || ans.App.Server != "pod-b-app" || ans.Proxy != nil {
		t.Errorf("the peer's connection to B: %+v, want B's app directly", ans)
	}
	for _, act := range h.client.Actions() {
		if act.GetVerb() == "delete" || act.GetVerb() == "patch" {
			t.Errorf("API action %s: want none", act.GetVerb())
		}
	}
	if h.count(ActionRepair, resultRefused) != 1 {
		t.Error("metrics: want one refusal")
	}
}

// skippedAtAdd says every pod's sandbox's ADD skipped it.
type skippedAtAdd struct{}

func (skippedAtAdd) Decided(*corev1.Pod) (sandboxstate.Decision, string) {
	return sandboxstate.Skipped, "sidecar.istio.io/interceptionMode=NONE"
}

// TestControllerNeverActsOnAPodAddSkipped: a pod whose validation fails but
// whose sandbox's ADD skipped it (its annotations changed since) is reported once,
// for every action; nothing is written, deleted or labelled.
func TestControllerNeverActsOnAPodAddSkipped(t *testing.T) {
	for _, action := range Actions {
		t.Run(string(action), func(t *testing.T) {
			h := start(t, action, func(o *Options, _ *fake.Clientset) { o.Decisions = skippedAtAdd{} }, brokenPod())
			e := h.nextEvent(t)
			if !strings.HasPrefix(e, "Warning "+ReasonRefused+" ") || !strings.Contains(e, "ADD skipped it (sidecar.istio.io/interceptionMode=NONE)") {
				t.Fatalf("Event %q: want %s naming the ADD's decision", e, ReasonRefused)
			}
			h.noEvent(t)
			if h.apply.count() != 0 || h.count(action, resultRefused) != 1 {
				t.Fatalf("applies %d, refused %v: want none and one", h.apply.count(), h.count(action, resultRefused))
			}
			for _, act := range h.client.Actions() {
				if v := act.GetVerb(); v != "get" && v != "list" && v != "watch" {
					t.Errorf("API action %s: want none", v)
				}
			}
		})
	}
}
