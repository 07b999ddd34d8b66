// Package podnetns finds a pod's network namespace on this host and holds it open
// (Handle), never the host's own.
//
// Locator (locate.go) is what acts on a pod uses: the namespace of the pod's
// sandbox as the agent recorded it at ADD, verified by device, inode and cookie,
// else the namespace of the pod's cgroup (found by the pod's UID), cross-checked
// by its addresses; never a namespace found by an IP alone.
//
// Finder finds a namespace from the pod's IP addresses: it scans bind-mounted netns
// files (where container runtimes keep them) and the network namespaces of the
// host's processes, and looks for the addresses on an interface other than
// loopback, over netlink, refusing to choose when several namespaces hold them. An
// address outlives its pod (IPAM gives it to the next sandbox), so Finder serves
// read-only inspection (meshcnictl inspect), never an action.
package podnetns

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"

	"github.com/meshcni/meshcni/pkg/netlink"
)

// DefaultNetnsDirs are where the common container runtimes bind-mount pod network
// namespaces, scanned in this order (a missing directory is skipped; the same
// directory reached twice, e.g. /var/run → /run, is scanned once):
//
//   - /var/run/netns, /run/netns: the CRI default of containerd
//     (netns_mounts_under_state_dir = false) and of CRI-O, and `ip netns`;
//   - /run/containerd/io.containerd.grpc.v1.cri/netns: containerd with
//     netns_mounts_under_state_dir = true and the default state dir;
//   - /run/k3s/containerd/io.containerd.grpc.v1.cri/netns: k3s's embedded containerd
//     with that setting;
//   - /var/run/docker/netns: Docker (cri-dockerd).
//
// A runtime with another state dir needs its directory passed in Finder.NetnsDirs
// (the meshcni test bed's containerd: /run/meshcni-testbed/containerd/io.containerd.grpc.v1.cri/netns).
var DefaultNetnsDirs = []string{
	"/var/run/netns",
	"/run/netns",
	"/run/containerd/io.containerd.grpc.v1.cri/netns",
	"/run/k3s/containerd/io.containerd.grpc.v1.cri/netns",
	"/var/run/docker/netns",
}

// Errors a caller can test with errors.Is.
var (
	// ErrNotFound: no network namespace on this host holds the addresses.
	ErrNotFound = errors.New("network namespace not found on this host")
	// ErrAmbiguous: several network namespaces hold the addresses, and none is the
	// only one to hold all of them: the finder refuses to choose.
	ErrAmbiguous = errors.New("several network namespaces hold the pod's addresses")
	// ErrHostNetwork: the pod shares the host's network namespace.
	ErrHostNetwork = errors.New("pod uses the host network")
	// ErrNoPodIP: the pod has no IP address yet.
	ErrNoPodIP = errors.New("pod has no IP address yet")
)

// Finder finds a pod's network namespace on this host.
type Finder struct {
	// NetnsDirs are directories of bind-mounted netns files to scan first
	// (nil: DefaultNetnsDirs; an empty, non-nil slice scans none).
	NetnsDirs []string
	// ProcDir is the proc filesystem to scan as well ("" = /proc; "-" = none).
	ProcDir string
}

// Handle is a network namespace held open: the namespace that was found and
// verified, whatever becomes of the path it was found through (a process that exits
// and whose PID is reused, a file unmounted). Enter it through NetnsPath or Fd, never
// through Path again. The caller closes it.
type Handle struct {
	// Path is the path the namespace was found through: a runtime's netns file, else
	// /proc/<pid>/ns/net. It names the namespace in messages.
	Path string
	fd   int
	id   nsID
}

// Fd is the handle's file descriptor (close-on-exec), for libraries that take one;
// -1 once closed.
func (h *Handle) Fd() int { return h.fd }

// NetnsPath is /proc/self/fd/<fd>: a path that opens the held namespace (setns,
// open) for as long as the handle is open, for APIs that take a path
// (engine.Options.NetnsPath, netnsutil.Do). Only this process can use it.
func (h *Handle) NetnsPath() string { return "/proc/self/fd/" + strconv.Itoa(h.fd) }

// Inode is the namespace's inode number (as `ls -iL` and `lsns` show it).
func (h *Handle) Inode() uint64 { return h.id.ino }

// Close releases the namespace; a second Close does nothing.
func (h *Handle) Close() error {
	if h == nil || h.fd < 0 {
		return nil
	}
	fd := h.fd
	h.fd = -1
	if err := unix.Close(fd); err != nil {
		return fmt.Errorf("close netns %s: %w", h.Path, err)
	}
	return nil
}

// Open opens the network namespace at path and holds it; a path that is not a
// network namespace is an error.
func Open(path string) (*Handle, error) {
	fd, id, err := openNS(path)
	if err != nil {
		return nil, fmt.Errorf("netns %s: %w", path, err)
	}
	return &Handle{Path: path, fd: fd, id: id}, nil
}

type nsID struct{ dev, ino uint64 }

// candidate is a namespace that holds some of the addresses, held open.
type candidate struct {
	Handle
	held []netip.Addr // in the order of scan.ips
}

// scan is the state of one Find: namespaces seen (by device and inode), the host's,
// the candidates found.
type scan struct {
	ips     []netip.Addr
	seen    map[nsID]bool
	scanned int
	errs    []error
	found   []*candidate
}

// Find returns the network namespace holding ips on interfaces other than lo, held
// open, or an error wrapping ErrNotFound or ErrAmbiguous.
//
// Every namespace reachable on the host is inspected, once however many paths lead
// to it (namespaces are told apart by device and inode, not path): the files of each
// directory of NetnsDirs (sorted by name), then /proc/<pid>/ns/net for every process
// (ascending PID). A namespace is named by the first path that led to it, so a
// runtime's netns file (containerd's cni-<uuid>, tied to the pod's sandbox) is
// preferred to a process's. The namespace returned is the only one that holds all
// of ips; when none holds all, the only one that holds any. Otherwise Find refuses
// to choose: several namespaces holding a pod's address are a stale namespace or a
// reused address, and the wrong choice would act on another pod.
func (f *Finder) Find(ctx context.Context, ips []netip.Addr) (*Handle, error) {
	if len(ips) == 0 {
		return nil, errors.New("find netns: no IP address given")
	}
	s := &scan{seen: map[nsID]bool{}}
	for _, ip := range ips {
		if ip = ip.Unmap(); !slices.Contains(s.ips, ip) {
			s.ips = append(s.ips, ip)
		}
	}
	host, err := ownNS()
	if err != nil {
		return nil, fmt.Errorf("find netns: the host's own netns: %w", err)
	}
	s.seen[host] = true
	dirs := f.NetnsDirs
	if dirs == nil {
		dirs = DefaultNetnsDirs
	}
	if err := s.all(ctx, dirs, f.ProcDir); err != nil {
		s.closeAll(nil)
		return nil, err
	}
	h, err := s.choose(dirs, f.ProcDir)
	s.closeAll(h)
	return h, err
}

// all inspects the namespaces of dirs, then of proc's processes.
func (s *scan) all(ctx context.Context, dirs []string, proc string) error {
	seenDirs := map[nsID]bool{}
	for _, dir := range dirs {
		var st unix.Stat_t
		if err := unix.Stat(dir, &st); err != nil {
			if !errors.Is(err, unix.ENOENT) {
				s.errs = append(s.errs, fmt.Errorf("%s: %w", dir, err))
			}
			continue
		}
		id := nsID{uint64(st.Dev), st.Ino}
		if seenDirs[id] {
			continue
		}
		seenDirs[id] = true
		entries, err := os.ReadDir(dir)
		if err != nil {
			s.errs = append(s.errs, fmt.Errorf("%s: %w", dir, err))
			continue
		}
		for _, e := range entries { // sorted by name
			if e.IsDir() {
				continue
			}
			if err := s.try(ctx, filepath.Join(dir, e.Name())); err != nil {
				return err
			}
		}
	}
	if proc == "-" {
		return nil
	}
	if proc == "" {
		proc = "/proc"
	}
	entries, err := os.ReadDir(proc)
	if err != nil {
		s.errs = append(s.errs, fmt.Errorf("%s: %w", proc, err))
	}
	var pids []int
	for _, e := range entries {
		if pid, err := strconv.Atoi(e.Name()); err == nil && pid > 0 {
			pids = append(pids, pid)
		}
	}
	sort.Ints(pids)
	for _, pid := range pids {
		if err := s.try(ctx, filepath.Join(proc, strconv.Itoa(pid), "ns", "net")); err != nil {
			return err
		}
	}
	return nil
}

// choose picks the namespace that holds all the addresses, else the only one that
// holds any.
func (s *scan) choose(dirs []string, proc string) (*Handle, error) {
	var full []*candidate
	for _, c := range s.found {
		if len(c.held) == len(s.ips) {
			full = append(full, c)
		}
	}
	switch {
	case len(full) == 1:
		return &full[0].Handle, nil
	case len(full) > 1:
		return nil, s.ambiguous(full)
	case len(s.found) == 1:
		return &s.found[0].Handle, nil
	case len(s.found) > 1:
		return nil, s.ambiguous(s.found)
	}
	return nil, s.notFound(dirs, proc)
}

// closeAll closes every candidate but keep.
func (s *scan) closeAll(keep *Handle) {
	for _, c := range s.found {
		if &c.Handle != keep {
			_ = c.Close()
		}
	}
}

func (s *scan) ambiguous(cs []*candidate) error {
	msgs := make([]string, len(cs))
	for i, c := range cs {
		msgs[i] = fmt.Sprintf("netns inode %d at %s holds %s", c.id.ino, c.Path, joinAddrs(c.held))
	}
	return fmt.Errorf("%w (%s): %s; refusing to choose (a stale namespace, or an address in use twice)",
		ErrAmbiguous, joinAddrs(s.ips), strings.Join(msgs, "; "))
}

func (s *scan) notFound(dirs []string, proc string) error {
	where := "netns dirs " + strings.Join(dirs, ", ")
	switch proc {
	case "-":
	case "":
		where += " and /proc"
	default:
		where += " and " + proc
	}
	err := fmt.Errorf("%w: no network namespace holds %s (%d namespaces looked into, in %s)",
		ErrNotFound, joinAddrs(s.ips), s.scanned, where)
	if len(s.errs) > 0 {
		// Unreadable candidates are common (processes that exit, unmounted files);
		// name a few so a permission problem is visible.
		const max = 3
		errs := s.errs
		more := ""
		if len(errs) > max {
			more = fmt.Sprintf(" (+%d more)", len(errs)-max)
			errs = errs[:max]
		}
		msgs := make([]string, len(errs))
		for i, e := range errs {
			msgs[i] = e.Error()
		}
		err = fmt.Errorf("%w; skipped: %s%s", err, strings.Join(msgs, "; "), more)
	}
	return err
}

func joinAddrs(ips []netip.Addr) string {
	s := make([]string, len(ips))
	for i, ip := range ips {
		s[i] = ip.String()
	}
	return strings.Join(s, ", ")
}

// try opens the namespace at path, once per namespace, and keeps it open as a
// candidate when it holds one of the addresses: what is identified, inspected and
// returned is the one open file. Only a cancelled context is returned as an error;
// unreadable candidates are noted.
func (s *scan) try(ctx context.Context, path string) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("find netns: %w", err)
	}
	// Most processes share a namespace already seen (the host's): a stat is enough
	// to skip them. What is inspected is identified by the open file below.
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err == nil && s.seen[nsID{uint64(st.Dev), st.Ino}] {
		return nil
	}
	fd, id, err := openNS(path)
	if err != nil {
		if !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.ESRCH) && !errors.Is(err, errNotNetns) {
			s.errs = append(s.errs, fmt.Errorf("%s: %w", path, err))
		}
		return nil
	}
	if s.seen[id] {
		unix.Close(fd)
		return nil
	}
	s.seen[id] = true
	s.scanned++
	held, err := holds(fd, s.ips)
	if err != nil || len(held) == 0 {
		if err != nil {
			s.errs = append(s.errs, fmt.Errorf("%s: %w", path, err))
		}
		unix.Close(fd)
		return nil
	}
	s.found = append(s.found, &candidate{Handle: Handle{Path: path, fd: fd, id: id}, held: held})
	return nil
}

var errNotNetns = errors.New("not a network namespace")

// nsGetNSType is NS_GET_NSTYPE (linux/nsfs.h, Linux 4.11): the type of a namespace fd.
const nsGetNSType = 0xb703

// openNS opens path, which must be a network namespace (a bind-mounted netns file or
// /proc/<pid>/ns/net; a plain file, an unmounted leftover, is not one), and
// identifies it by the open file. O_NONBLOCK: a FIFO left in a netns directory must
// not block the scan.
func openNS(path string) (int, nsID, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return -1, nsID{}, err
	}
	id, err := fdNS(fd)
	if err != nil {
		unix.Close(fd)
		return -1, nsID{}, err
	}
	return fd, id, nil
}

func fdNS(fd int) (nsID, error) {
	var sfs unix.Statfs_t
	if err := unix.Fstatfs(fd, &sfs); err != nil {
		return nsID{}, err
	}
	if sfs.Type != unix.NSFS_MAGIC {
		return nsID{}, errNotNetns
	}
	if t, err := unix.IoctlRetInt(fd, nsGetNSType); err == nil && t != unix.CLONE_NEWNET {
		return nsID{}, errNotNetns // another kind of namespace (a kernel without the ioctl: assumed net)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nsID{}, err
	}
	return nsID{uint64(st.Dev), st.Ino}, nil
}

// ownNS identifies the network namespace this process runs in: the calling thread's,
// locked for the look-up. (/proc/self/ns/net is the main thread's, which in a Go
// program may have been left in another namespace: a goroutine that locks the main
// thread, enters a netns and exits without unlocking wedges that thread there.)
func ownNS() (nsID, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	fd, id, err := openNS("/proc/thread-self/ns/net")
	if err != nil {
		return nsID{}, err
	}
	unix.Close(fd)
	return id, nil
}

// holds lists the namespace's addresses and links over a netlink socket opened in
// it (pkg/netlink; no thread of ours enters it beyond the socket's creation) and
// returns those of ips that sit on a link that is not a loopback, in the order of
// ips.
func holds(fd int, ips []netip.Addr) ([]netip.Addr, error) {
	c, err := netlink.OpenIn(fmt.Sprintf("/proc/self/fd/%d", fd), unix.NETLINK_ROUTE)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	addrs, err := netlink.ListAddrs(c)
	if err != nil {
		return nil, err
	}
	var links []netlink.Link // listed once, only when an address is one of ips
	on := map[netip.Addr]bool{}
	for _, a := range addrs {
		if !slices.Contains(ips, a.IP) {
			continue
		}
		if links == nil {
			if links, err = netlink.ListLinks(c); err != nil {
				return nil, err
			}
		}
		i := slices.IndexFunc(links, func(l netlink.Link) bool { return l.Index == a.Index })
		if i < 0 {
			return nil, fmt.Errorf("address %s on link %d, which the namespace does not list", a.IP, a.Index)
		}
		if !links[i].Loopback() {
			on[a.IP] = true
		}
	}
	var held []netip.Addr
	for _, ip := range ips {
		if on[ip] {
			held = append(held, ip)
		}
	}
	return held, nil
}

// PodIPs returns the pod's addresses from its status (status.podIPs, else status.podIP).
func PodIPs(pod *corev1.Pod) ([]netip.Addr, error) {
	var out []netip.Addr
	add := func(s string) error {
		ip, err := netip.ParseAddr(s)
		if err != nil {
			return fmt.Errorf("pod %s/%s: bad IP %q in status: %w", pod.Namespace, pod.Name, s, err)
		}
		for _, o := range out {
			if o == ip.Unmap() {
				return nil
			}
		}
		out = append(out, ip.Unmap())
		return nil
	}
	for _, p := range pod.Status.PodIPs {
		if err := add(p.IP); err != nil {
			return nil, err
		}
	}
	if len(out) == 0 && pod.Status.PodIP != "" {
		if err := add(pod.Status.PodIP); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// FindPod finds the pod's network namespace from its status.podIPs and holds it open
// (Find). A hostNetwork pod is an error wrapping ErrHostNetwork, a pod without an IP
// one wrapping ErrNoPodIP.
func (f *Finder) FindPod(ctx context.Context, pod *corev1.Pod) (*Handle, error) {
	if pod == nil {
		return nil, errors.New("find netns: no pod")
	}
	if pod.Spec.HostNetwork {
		return nil, fmt.Errorf("pod %s/%s: %w (it has no network namespace of its own)", pod.Namespace, pod.Name, ErrHostNetwork)
	}
	ips, err := PodIPs(pod)
	if err != nil {
		return nil, err
	}
	if len(ips) == 0 {
		return nil, fmt.Errorf("pod %s/%s: %w (phase %s)", pod.Namespace, pod.Name, ErrNoPodIP, pod.Status.Phase)
	}
	h, err := f.Find(ctx, ips)
	if err != nil {
		return nil, fmt.Errorf("pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	return h, nil
}
