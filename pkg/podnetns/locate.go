package podnetns

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"

	"github.com/meshcni/meshcni/pkg/netnsutil"
)

// Errors of Locate a caller can test with errors.Is (besides ErrNotFound,
// ErrAmbiguous, ErrHostNetwork).
var (
	// ErrGone: the netns recorded for the pod's sandbox no longer exists.
	ErrGone = errors.New("the network namespace recorded for the pod's sandbox is gone")
	// ErrMismatch: the namespace found is not the pod's: it is another one than
	// the recorded (another inode, or the same inode with another cookie: the
	// inode was reused), it is recorded for another sandbox, or it does not hold
	// the pod's addresses.
	ErrMismatch = errors.New("the network namespace found is not the pod's sandbox's")
)

// Identity names a network namespace: its nsfs file's device and inode, and its
// SO_NETNS_COOKIE (0: unknown), which, unlike the inode, is never reused while the
// host runs.
type Identity struct {
	Dev, Inode, Cookie uint64
}

func (i Identity) String() string {
	if i.Cookie == 0 {
		return fmt.Sprintf("netns inode %d (device %d)", i.Inode, i.Dev)
	}
	return fmt.Sprintf("netns inode %d (device %d, cookie %d)", i.Inode, i.Dev, i.Cookie)
}

// Sandbox is one pod sandbox as the agent recorded it at its ADD.
type Sandbox struct {
	ID     string
	PodUID string
	// Path is CNI_NETNS; Netns the identity the plugin read there (Inode 0: none).
	Path  string
	Netns Identity
}

// Records are the agent's records of the sandboxes of its node (pkg/agent).
type Records interface {
	// PodSandbox is the newest sandbox recorded for the pod UID.
	PodSandbox(podUID string) (Sandbox, bool)
	// Holders are the sandboxes recorded with the namespace of that device and
	// inode (any pod's).
	Holders(dev, inode uint64) []Sandbox
}

// Locator finds a pod's network namespace by its sandbox, never by an IP alone:
//
//   - a pod with a recorded sandbox: the recorded namespace (its CNI_NETNS path,
//     else the one its processes run in), verified to be the recorded one (device,
//     inode and cookie); ErrGone when it no longer exists, ErrMismatch when it is
//     another;
//   - a pod without one (its sandbox was created before meshcni was in the chain,
//     or before the agent kept records): the namespace the processes of the pod's
//     cgroup run in (the kubelet names each pod's cgroup after its UID: cgroupfs
//     …/pod<uid>/…, systemd …-pod<uid_with_underscores>.slice), ErrAmbiguous when
//     they run in several, then cross-checked: it must hold every address of the
//     pod's status and must not be recorded for another pod's sandbox
//     (ErrMismatch).
type Locator struct {
	// ProcDir is the proc filesystem ("" = /proc).
	ProcDir string
	// Records are the sandboxes recorded (nil: none; every pod by its cgroup).
	Records Records
	// NetnsDirs, when set, are the runtime's netns directories where a pod without a
	// record is looked for by its addresses when no pod's process is visible here
	// (an agent without the host's PID namespace). What is found there
	// is cross-checked as a namespace found through the cgroup: it holds every
	// address of the pod and is recorded for no other sandbox.
	NetnsDirs []string
}

// errNoProcess: no pod's process is visible in the proc filesystem (this process
// does not see the host's).
var errNoProcess = errors.New("the host's processes are not visible here")

// Locate returns the pod's network namespace, held open.
func (l *Locator) Locate(ctx context.Context, pod *corev1.Pod) (*Handle, error) {
	if pod == nil {
		return nil, errors.New("locate netns: no pod")
	}
	name := pod.Namespace + "/" + pod.Name
	if pod.Spec.HostNetwork {
		return nil, fmt.Errorf("pod %s: %w (it has no network namespace of its own)", name, ErrHostNetwork)
	}
	var h *Handle
	var err error
	sb, ok := Sandbox{}, false
	if l.Records != nil {
		sb, ok = l.Records.PodSandbox(string(pod.UID))
	}
	if ok && sb.Netns.Inode != 0 {
		h, err = l.recorded(ctx, pod, sb)
	} else {
		h, err = l.unrecorded(ctx, pod)
	}
	if err != nil {
		return nil, fmt.Errorf("pod %s: %w", name, err)
	}
	return h, nil
}

// recorded opens the sandbox's recorded namespace and verifies it.
func (l *Locator) recorded(ctx context.Context, pod *corev1.Pod, sb Sandbox) (*Handle, error) {
	h, err := Open(sb.Path)
	if sb.Path == "" || errors.Is(err, unix.ENOENT) || errors.Is(err, errNotNetns) {
		// Unmounted, or not visible here: the namespace the pod's processes run in,
		// when it is the recorded one.
		h, err = l.byCgroup(ctx, string(pod.UID))
		if errors.Is(err, ErrNotFound) {
			return nil, fmt.Errorf("%w: sandbox %s, %s at %s: %v", ErrGone, sb.ID, sb.Netns, sb.Path, err)
		}
	}
	if err != nil {
		return nil, err
	}
	if err := verify(h, sb); err != nil {
		h.Close()
		return nil, err
	}
	return h, nil
}

// verify checks that h is the sandbox's recorded namespace, and that no other
// sandbox is recorded with it.
func verify(h *Handle, sb Sandbox) error {
	got := Identity{Dev: h.id.dev, Inode: h.id.ino}
	if got.Dev != sb.Netns.Dev || got.Inode != sb.Netns.Inode {
		return fmt.Errorf("%w: sandbox %s was recorded with %s, %s holds %s", ErrMismatch, sb.ID, sb.Netns, h.Path, got)
	}
	if sb.Netns.Cookie == 0 {
		return nil
	}
	c, err := h.Cookie()
	if err != nil {
		return fmt.Errorf("sandbox %s: %w", sb.ID, err)
	}
	if c != sb.Netns.Cookie {
		got.Cookie = c
		return fmt.Errorf("%w: sandbox %s was recorded with %s, %s holds %s: the inode was reused by another namespace", ErrMismatch, sb.ID, sb.Netns, h.Path, got)
	}
	return nil
}

// unrecorded finds the namespace of the pod's cgroup and cross-checks it.
func (l *Locator) unrecorded(ctx context.Context, pod *corev1.Pod) (*Handle, error) {
	h, err := l.byCgroup(ctx, string(pod.UID))
	if errors.Is(err, errNoProcess) && len(l.NetnsDirs) > 0 {
		f := Finder{NetnsDirs: l.NetnsDirs, ProcDir: "-"}
		h, err = f.FindPod(ctx, pod)
	}
	if err != nil {
		return nil, err
	}
	if err := l.crossCheck(h, pod); err != nil {
		h.Close()
		return nil, err
	}
	return h, nil
}

// crossCheck refuses a namespace recorded for another pod's sandbox, or one that
// does not hold every address of the pod's status.
func (l *Locator) crossCheck(h *Handle, pod *corev1.Pod) error {
	if l.Records != nil {
		for _, o := range l.Records.Holders(h.id.dev, h.id.ino) {
			if o.PodUID != string(pod.UID) {
				return fmt.Errorf("%w: %s at %s is recorded for sandbox %s of pod UID %s", ErrMismatch, h.Identity(), h.Path, o.ID, o.PodUID)
			}
		}
	}
	ips, err := PodIPs(pod)
	if err != nil || len(ips) == 0 {
		return err
	}
	held, err := holds(h.fd, ips)
	if err != nil {
		return fmt.Errorf("%s: %w", h.Path, err)
	}
	if len(held) != len(ips) {
		return fmt.Errorf("%w: %s at %s, where the pod's processes run, holds %s of the pod's addresses %s", ErrMismatch, h.Identity(), h.Path, orNone(held), joinAddrs(ips))
	}
	return nil
}

// Identity is the namespace's device and inode (Cookie 0: not read).
func (h *Handle) Identity() Identity { return Identity{Dev: h.id.dev, Inode: h.id.ino} }

// Cookie reads the namespace's SO_NETNS_COOKIE (Linux 5.14).
func (h *Handle) Cookie() (uint64, error) { return netnsutil.Cookie(h.NetnsPath()) }

// Cookied is the namespace's identity with its cookie.
func (h *Handle) Cookied() (Identity, error) {
	id := h.Identity()
	c, err := h.Cookie()
	if err != nil {
		return id, err
	}
	id.Cookie = c
	return id, nil
}

// MaxCgroupFile bounds what is read of one /proc/<pid>/cgroup.
const MaxCgroupFile = 64 << 10

// byCgroup opens the namespace the processes of the pod's cgroup run in: exactly
// one, other than this process's own.
func (l *Locator) byCgroup(ctx context.Context, uid string) (*Handle, error) {
	if uid == "" {
		return nil, fmt.Errorf("%w: the pod has no UID to find its cgroup by", ErrNotFound)
	}
	proc := l.ProcDir
	if proc == "" {
		proc = "/proc"
	}
	pids, others, err := pidsOf(ctx, proc, strings.ToLower(uid))
	if err != nil {
		return nil, err
	}
	host, err := ownNS()
	if err != nil {
		return nil, fmt.Errorf("the host's own netns: %w", err)
	}
	found := map[nsID][]int{}
	var handles []*Handle
	for _, pid := range pids {
		path := filepath.Join(proc, strconv.Itoa(pid), "ns", "net")
		fd, id, err := openNS(path)
		if err != nil {
			continue // exited
		}
		if id == host || found[id] != nil {
			found[id] = append(found[id], pid)
			unix.Close(fd)
			continue
		}
		found[id] = []int{pid}
		handles = append(handles, &Handle{Path: path, fd: fd, id: id})
	}
	switch len(handles) {
	case 1:
		return handles[0], nil
	case 0:
		if len(pids) == 0 && !others {
			return nil, fmt.Errorf("%w: no process of pod UID %s in %s, nor of any other pod: %w", ErrNotFound, uid, proc, errNoProcess)
		}
		return nil, fmt.Errorf("%w: no process of pod UID %s in a network namespace of its own in %s (%d in its cgroup)", ErrNotFound, uid, proc, len(pids))
	}
	msgs := make([]string, len(handles))
	for i, h := range handles {
		msgs[i] = fmt.Sprintf("%s: PIDs %v", h.Identity(), found[h.id])
		h.Close()
	}
	return nil, fmt.Errorf("%w: the processes of pod UID %s run in %d network namespaces (%s); refusing to choose",
		ErrAmbiguous, uid, len(handles), strings.Join(msgs, "; "))
}

// pidsOf lists the processes whose cgroup names the pod UID, ascending, and says
// whether a process of another pod (not this process's own) is visible at all:
// where none is, this process does not see the host's processes.
func pidsOf(ctx context.Context, proc, uid string) ([]int, bool, error) {
	entries, err := os.ReadDir(proc)
	if err != nil {
		return nil, false, fmt.Errorf("%s: %w", proc, err)
	}
	self := podUIDOf("/proc/self/cgroup")
	var pids []int
	others := false
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid <= 0 {
			continue
		}
		if err := ctx.Err(); err != nil {
			return nil, false, fmt.Errorf("locate netns: %w", err)
		}
		switch got := podUIDOf(filepath.Join(proc, e.Name(), "cgroup")); got {
		case uid:
			pids = append(pids, pid)
		case "", self:
		default:
			others = true
		}
	}
	sort.Ints(pids)
	return pids, others, nil
}

// podUIDOf is the pod UID the cgroup file (hierarchy-ID:controllers:path lines)
// puts its process in ("": none).
func podUIDOf(path string) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	sc := bufio.NewScanner(io.LimitReader(f, MaxCgroupFile))
	for sc.Scan() {
		_, rest, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		if _, cg, ok := strings.Cut(rest, ":"); ok {
			if u := CgroupPodUID(cg); u != "" {
				return u
			}
		}
	}
	return ""
}

// CgroupPodUID is the pod UID a cgroup path names ("" : none): the kubelet's pod
// cgroup is pod<uid> (cgroupfs driver: /kubepods/burstable/pod<uid>/<container>)
// or kubepods-<qos>-pod<uid with '_' for '-'>.slice (systemd driver).
func CgroupPodUID(cgroup string) string {
	uid := ""
	for _, seg := range strings.Split(cgroup, "/") {
		seg = strings.TrimSuffix(seg, ".slice")
		i := strings.LastIndex(seg, "pod")
		if i < 0 || (i > 0 && seg[i-1] != '-') || (i > 0 && !strings.HasPrefix(seg, "kubepods")) {
			continue
		}
		if c := strings.ReplaceAll(seg[i+3:], "_", "-"); isUID(c) {
			uid = strings.ToLower(c)
		}
	}
	return uid
}

// isUID accepts what a pod UID is: a UUID, or a static pod's 32 hex digits.
func isUID(s string) bool {
	if len(s) != 36 && len(s) != 32 {
		return false
	}
	for i, c := range s {
		dash := len(s) == 36 && (i == 8 || i == 13 || i == 18 || i == 23)
		switch {
		case dash && c != '-':
			return false
		case !dash && !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F'):
			return false
		}
	}
	return true
}

func orNone(ips []netip.Addr) string {
	if len(ips) == 0 {
		return "none"
	}
	return joinAddrs(ips)
}
