package podnetns_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/netnsutil"
	"github.com/meshcni/meshcni/pkg/podnetns"
)

func TestCgroupPodUID(t *testing.T) {
	const uid = "1b4e28ba-2fa1-11d2-883f-0016d3cca427"
	for _, tt := range []struct{ cgroup, want string }{
		{"/kubepods/besteffort/pod" + uid + "/0123abcd", uid},
		{"/kubepods/pod" + uid + "/0123abcd", uid},
		{"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1b4e28ba_2fa1_11d2_883f_0016d3cca427.slice/cri-containerd-0123.scope", uid},
		{"/kubepods.slice/kubepods-pod1b4e28ba_2fa1_11d2_883f_0016d3cca427.slice/cri-containerd-0123.scope", uid},
		{"/../../kubepods/besteffort/pod" + uid + "/abc", uid}, // seen from another cgroup namespace
		{"/kubepods/besteffort/pod" + strings.ToUpper(uid) + "/abc", uid},
		{"/kubepods/besteffort/pod6f1f0d1c2f0a4c9e9d2b8a7c6e5f4d3c/abc", "6f1f0d1c2f0a4c9e9d2b8a7c6e5f4d3c"}, // a static pod's
		{"/system.slice/containerd.service", ""},
		{"/kubepods/besteffort/podnotauid/abc", ""},
		{"/user.slice/my-pod" + uid + ".slice", ""}, // not the kubelet's
		{"/kubepods/besteffort/xpod" + uid, ""},
		{"/", ""},
	} {
		if got := podnetns.CgroupPodUID(tt.cgroup); got != tt.want {
			t.Errorf("CgroupPodUID(%q) = %q, want %q", tt.cgroup, got, tt.want)
		}
	}
}

// records is a fixed set of recorded sandboxes.
type records []podnetns.Sandbox

func (r records) PodSandbox(uid string) (podnetns.Sandbox, bool) {
	for _, s := range r {
		if s.PodUID == uid {
			return s, true
		}
	}
	return podnetns.Sandbox{}, false
}

func (r records) Holders(dev, ino uint64) []podnetns.Sandbox {
	var out []podnetns.Sandbox
	for _, s := range r {
		if s.Netns.Dev == dev && s.Netns.Inode == ino {
			out = append(out, s)
		}
	}
	return out
}

// identity reads a netns file's device, inode and cookie.
func identity(t testing.TB, path string) podnetns.Identity {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	c, err := netnsutil.Cookie(path)
	if err != nil {
		t.Fatal(err)
	}
	return podnetns.Identity{Dev: uint64(st.Dev), Inode: st.Ino, Cookie: c}
}

// fakeProc is a proc directory of processes: each a cgroup file and ns/net, a
// link to a real network namespace.
type fakeProc struct {
	dir  string
	next int
}

func (p *fakeProc) add(t *testing.T, cgroup, netns string) {
	t.Helper()
	p.next++
	d := filepath.Join(p.dir, strconv.Itoa(100+p.next))
	if err := os.MkdirAll(filepath.Join(d, "ns"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(d, "cgroup"), []byte("0::"+cgroup+"\n"), 0o444); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(netns, filepath.Join(d, "ns", "net")); err != nil {
		t.Fatal(err)
	}
}

func locPod(uid, ip string) *corev1.Pod {
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "app", Name: "a", UID: types.UID(uid)},
		Status: corev1.PodStatus{PodIP: ip, PodIPs: []corev1.PodIP{{IP: ip}}}}
}

// TestLocate: a pod's netns is found by its sandbox's record, else by its UID's
// cgroup, and every doubt is refused with the error that names it. Real network
// namespaces (bind-mounted as runtimes do); the proc directory is made of links to
// them with the kubelet's cgroup paths.
func TestLocate(t *testing.T) {
	testutil.RequireRoot(t)
	const uidA, uidB = "aaaaaaaa-0000-4000-8000-000000000001", "bbbbbbbb-0000-4000-8000-000000000002"
	ipA, _ := uniqueAddrs()
	ipOther, _ := uniqueAddrs()
	dir := t.TempDir()
	nsA := bindInto(t, dir, "cni-a", podNetns(t, false, ipA))
	nsB := bindInto(t, dir, "cni-b", podNetns(t, false, ipA)) // B holds A's address
	idA, idB := identity(t, nsA), identity(t, nsB)
	dirA, dirB := t.TempDir(), t.TempDir() // the runtime's netns directories as an agent sees them
	bindInto(t, dirA, "cni-a", nsA)
	bindInto(t, dirB, "cni-b", nsB)
	cg := func(uid string) string { return "/kubepods/besteffort/pod" + uid + "/ctr" }
	reused := idA
	reused.Cookie++
	for _, tt := range []struct {
		name    string
		records records
		procs   [][2]string // cgroup, netns
		dirs    []string    // Locator.NetnsDirs
		pod     *corev1.Pod
		want    string // the netns found, else
		err     error
		errPart string
	}{
		{name: "recorded", records: records{{ID: "sa", PodUID: uidA, Path: nsA, Netns: idA}}, pod: locPod(uidA, ipA.String()), want: nsA},
		{name: "recorded, stale IP held elsewhere", records: records{{ID: "sa", PodUID: uidA, Path: nsA, Netns: idA}}, pod: locPod(uidA, ipOther.String()), want: nsA},
		{name: "recorded, path not visible: by cgroup", records: records{{ID: "sa", PodUID: uidA, Path: filepath.Join(dir, "unseen"), Netns: idA}},
			procs: [][2]string{{cg(uidA), nsA}}, pod: locPod(uidA, ipA.String()), want: nsA},
		{name: "recorded netns gone", records: records{{ID: "sa", PodUID: uidA, Path: filepath.Join(dir, "gone"), Netns: idA}},
			pod: locPod(uidA, ipA.String()), err: podnetns.ErrGone, errPart: "sandbox sa"},
		{name: "recorded path holds another netns", records: records{{ID: "sa", PodUID: uidA, Path: nsB, Netns: idA}},
			pod: locPod(uidA, ipA.String()), err: podnetns.ErrMismatch, errPart: "was recorded with netns inode"},
		{name: "recorded inode reused (another cookie)", records: records{{ID: "sa", PodUID: uidA, Path: nsA, Netns: reused}},
			pod: locPod(uidA, ipA.String()), err: podnetns.ErrMismatch, errPart: "inode was reused"},
		{name: "unrecorded: by cgroup", procs: [][2]string{{cg(uidB), nsB}, {cg(uidA), nsA}, {cg(uidA), nsA}}, pod: locPod(uidA, ipA.String()), want: nsA},
		{name: "unrecorded: UID in two netns", procs: [][2]string{{cg(uidA), nsA}, {cg(uidA), nsB}}, pod: locPod(uidA, ipA.String()),
			err: podnetns.ErrAmbiguous, errPart: "run in 2 network namespaces"},
		{name: "unrecorded: netns recorded for another sandbox", records: records{{ID: "sb", PodUID: uidB, Path: nsB, Netns: idB}},
			procs: [][2]string{{cg(uidA), nsB}}, pod: locPod(uidA, ipA.String()), err: podnetns.ErrMismatch, errPart: "recorded for sandbox sb of pod UID " + uidB},
		{name: "unrecorded: netns without the pod's IP", procs: [][2]string{{cg(uidA), nsA}}, pod: locPod(uidA, ipOther.String()),
			err: podnetns.ErrMismatch, errPart: "holds none of the pod's addresses " + ipOther.String()},
		{name: "unrecorded: no process", procs: [][2]string{{cg(uidB), nsB}}, pod: locPod(uidA, ipA.String()), err: podnetns.ErrNotFound, errPart: "no process of pod UID " + uidA},
		{name: "unrecorded: IP alone is never enough", pod: locPod(uidA, ipA.String()), err: podnetns.ErrNotFound},
		{name: "unrecorded, no process visible: by the netns dirs, cross-checked", dirs: []string{dirA}, pod: locPod(uidA, ipA.String()), want: nsA},
		{name: "unrecorded, no process visible: two netns dirs' namespaces hold the IP", dirs: []string{dirA, dirB}, pod: locPod(uidA, ipA.String()),
			err: podnetns.ErrAmbiguous, errPart: "refusing to choose"},
		{name: "unrecorded, no process visible: the dirs' namespace is recorded for another sandbox", dirs: []string{dirB},
			records: records{{ID: "sb", PodUID: uidB, Path: nsB, Netns: idB}}, pod: locPod(uidA, ipA.String()),
			err: podnetns.ErrMismatch, errPart: "recorded for sandbox sb of pod UID " + uidB},
		{name: "unrecorded, processes visible: the netns dirs are not consulted", dirs: []string{dirA}, procs: [][2]string{{cg(uidB), nsB}},
			pod: locPod(uidA, ipA.String()), err: podnetns.ErrNotFound, errPart: "no process of pod UID " + uidA},
	} {
		t.Run(tt.name, func(t *testing.T) {
			p := &fakeProc{dir: t.TempDir()}
			for _, pr := range tt.procs {
				p.add(t, pr[0], pr[1])
			}
			l := &podnetns.Locator{ProcDir: p.dir, NetnsDirs: tt.dirs}
			if tt.records != nil {
				l.Records = tt.records
			}
			h, err := l.Locate(context.Background(), tt.pod)
			if tt.err != nil {
				if !errors.Is(err, tt.err) || !strings.Contains(err.Error(), tt.errPart) || !strings.Contains(err.Error(), "pod app/a") {
					t.Fatalf("err %v, want %v naming the pod and %q", err, tt.err, tt.errPart)
				}
				if h != nil {
					t.Fatal("a handle with an error")
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer h.Close()
			if !sameNS(t, h.NetnsPath(), tt.want) {
				t.Fatalf("found %s (%v), want %s", h.Path, h.Identity(), tt.want)
			}
		})
	}
}
