package audit_test

// A pod's network namespace is its sandbox's, never the one that holds its IP
// address: pod A's sandbox is gone, its status still carries IP X, and IPAM gave X
// to an unmeshed sandbox B. Real network namespaces, real packets.

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"

	itestutil "github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/internal/testkit/traffic"
	"github.com/meshcni/meshcni/pkg/audit"
	"github.com/meshcni/meshcni/pkg/engine"
	"github.com/meshcni/meshcni/pkg/netnsutil"
	"github.com/meshcni/meshcni/pkg/podnetns"
)

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

// bind bind-mounts the namespace file src at dir/name (as runtimes do).
func bind(t *testing.T, dir, name, src string) string {
	t.Helper()
	dst := filepath.Join(dir, name)
	if err := unix.Mount(src, touch(t, dst), "none", unix.MS_BIND, ""); err != nil {
		t.Fatalf("bind %s at %s: %v", src, dst, err)
	}
	t.Cleanup(func() { _ = unix.Unmount(dst, unix.MNT_DETACH) })
	return dst
}

func touch(t *testing.T, path string) string {
	t.Helper()
	if err := os.WriteFile(path, nil, 0o444); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestStaleIPHeldByAnotherSandbox: the IP finder the audit used would hand A's
// redirect B's netns; the audit locating A by its sandbox's record leaves B
// untouched (no rule, its packets reach its app directly, with a proxy listening
// that would catch them otherwise), reports A (Event, metric) and deletes nothing,
// whatever the actions.
func TestStaleIPHeldByAnotherSandbox(t *testing.T) {
	itestutil.RequireRoot(t)
	ctx := context.Background()
	dir := t.TempDir()
	b := traffic.NewPod(t) // B: unmeshed, holds X = traffic.PodIPv4
	traffic.StartApp(t, b.PeerNetNS, peer4, "peer-app")
	traffic.StartApp(t, b.NetNS, pod4, "pod-b-app")
	traffic.StartProxy(t, b.NetNS, traffic.ProxyOptions{})
	nsB := bind(t, dir, "cni-b", b.NetNS)
	gone := itestutil.NewNetns(t) // A's sandbox netns, recorded at its ADD, then deleted
	recA := recordOf(t, "sandbox-a", "uid-a", gone)
	if err := itestutil.DeleteNetns(gone); err != nil {
		t.Fatal(err)
	}
	recB := recordOf(t, "sandbox-b", "uid-b", nsB)
	podA := owned(meshedPod("a", traffic.PodIPv4.String(), nil))
	podA.Spec.InitContainers = nil // validation-free: the audit's escaped case
	podA.UID = types.UID("uid-a")

	h, err := (&podnetns.Finder{NetnsDirs: []string{dir}, ProcDir: "-"}).FindPod(ctx, podA)
	if err != nil {
		t.Fatalf("the IP finder: %v", err)
	}
	if h.Inode() != recB.Netns.Inode {
		t.Fatalf("the IP finder found inode %d, B's is %d: the reproduction does not hold", h.Inode(), recB.Netns.Inode)
	}
	h.Close()

	for _, actions := range [][2]audit.Action{{audit.ActionRepair, audit.ActionEvict}, {audit.ActionRepair, audit.ActionRepair}} {
		t.Run(string(actions[0])+"-"+string(actions[1]), func(t *testing.T) {
			client := fake.NewClientset(podA)
			p := &pods{list: []*corev1.Pod{podA}}
			loc := &podnetns.Locator{ProcDir: t.TempDir(), Records: sandboxes{recA, recB}}
			a, rec, m := newAuditorWith(t, p, loc, func(o *audit.Options) {
				o.Action, o.EscapedAction, o.Client, o.Evictor = actions[0], actions[1], client, evictor(client)
			})
			for i := range 3 {
				if st := a.Round(ctx); st[audit.Reported] != 1 {
					t.Fatalf("round %d: %v, want A reported", i, st)
				}
			}
			live, err := engine.Live(ctx, engine.Options{NetnsPath: b.NetNS})
			if err != nil {
				t.Fatal(err)
			}
			for k, txt := range live {
				if strings.TrimSpace(txt) != "" {
					t.Errorf("B's netns holds %s rules:\n%s", k, txt)
				}
			}
			ans := traffic.Dial(t, b.PeerNetNS, pod4, traffic.DialOptions{Cred: appUser})
			if ans.App == nil || ans.App.Server != "pod-b-app" || ans.Proxy != nil {
				t.Errorf("the peer's connection to B: %+v, want B's app directly", ans)
			}
			for _, act := range client.Actions() {
				if act.GetVerb() == "delete" || act.GetVerb() == "create" {
					t.Errorf("API action %s %s: want none", act.GetVerb(), act.GetResource().Resource)
				}
			}
			evs := events(rec)
			if len(evs) != 1 || !hasEvent(evs, audit.EventRefused, "sandbox sandbox-a", "gone", "nothing was changed or deleted") {
				t.Errorf("events %q: want one Warning %s naming A's sandbox", evs, audit.EventRefused)
			}
			if n := testutil.ToFloat64(m.Refused.WithLabelValues(audit.RefusedGone)); n != 3 {
				t.Errorf("refused{netns-gone} %v, want 3 (one per round)", n)
			}
		})
	}
}
