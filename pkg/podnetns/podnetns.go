// Package podnetns finds a pod's network namespace on this host from the pod's IP
// addresses: it scans bind-mounted netns files (where container runtimes keep them)
// and, as a fallback, the network namespaces of the host's processes, and looks for
// the addresses on an interface other than loopback, over netlink. The host's own
// network namespace is never returned.
package podnetns

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
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
	// ProcDir is the proc filesystem to scan as a fallback ("" = /proc; "-" = no fallback).
	ProcDir string
}

type nsID struct{ dev, ino uint64 }

// scan is the state of one Find: namespaces seen (by device and inode), the host's.
type scan struct {
	ips     map[netip.Addr]bool
	seen    map[nsID]bool
	host    nsID
	scanned int
	errs    []error
}

// Find returns a path that opens the netns holding any of ips on an interface other than lo
// (a file in NetnsDirs or /proc/<pid>/ns/net), or an error wrapping ErrNotFound.
//
// Candidates are tried in order: each directory of NetnsDirs (entries sorted by
// name), then /proc/<pid>/ns/net for every process (ascending PID). Each namespace is
// inspected once, however many paths lead to it; the first that holds an address wins.
func (f *Finder) Find(ctx context.Context, ips []netip.Addr) (string, error) {
	if len(ips) == 0 {
		return "", errors.New("find netns: no IP address given")
	}
	s := &scan{ips: map[netip.Addr]bool{}, seen: map[nsID]bool{}}
	for _, ip := range ips {
		s.ips[ip.Unmap()] = true
	}
	host, err := ownNS()
	if err != nil {
		return "", fmt.Errorf("find netns: the host's own netns: %w", err)
	}
	s.host = host
	s.seen[host] = true

	dirs := f.NetnsDirs
	if dirs == nil {
		dirs = DefaultNetnsDirs
	}
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
			if p, ok, err := s.try(ctx, filepath.Join(dir, e.Name())); err != nil || ok {
				return p, err
			}
		}
	}

	if f.ProcDir != "-" {
		proc := f.ProcDir
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
			if p, ok, err := s.try(ctx, filepath.Join(proc, strconv.Itoa(pid), "ns", "net")); err != nil || ok {
				return p, err
			}
		}
	}
	return "", s.notFound(ips, dirs, f.ProcDir)
}

func (s *scan) notFound(ips []netip.Addr, dirs []string, proc string) error {
	where := "netns dirs " + strings.Join(dirs, ", ")
	switch proc {
	case "-":
	case "":
		where += " and /proc"
	default:
		where += " and " + proc
	}
	err := fmt.Errorf("%w: no network namespace holds %s (%d namespaces looked into, in %s)",
		ErrNotFound, joinAddrs(ips), s.scanned, where)
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

// try inspects the namespace at path once: ok when it holds one of the addresses.
// Only a cancelled context is returned as an error; unreadable candidates are noted.
func (s *scan) try(ctx context.Context, path string) (string, bool, error) {
	if err := ctx.Err(); err != nil {
		return "", false, fmt.Errorf("find netns: %w", err)
	}
	id, err := statNS(path)
	if err != nil {
		if !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.ESRCH) && !errors.Is(err, errNotNetns) {
			s.errs = append(s.errs, fmt.Errorf("%s: %w", path, err))
		}
		return "", false, nil
	}
	if s.seen[id] {
		return "", false, nil
	}
	s.seen[id] = true
	s.scanned++
	ok, err := holds(path, s.ips)
	if err != nil {
		s.errs = append(s.errs, fmt.Errorf("%s: %w", path, err))
		return "", false, nil
	}
	return path, ok, nil
}

var errNotNetns = errors.New("not a network namespace")

// ownNS identifies the network namespace this process runs in: the calling thread's,
// locked for the look-up. (/proc/self/ns/net is the main thread's, which in a Go
// program may have been left in another namespace: a goroutine that locks the main
// thread, enters a netns and exits without unlocking wedges that thread there.)
func ownNS() (nsID, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	return statNS("/proc/thread-self/ns/net")
}

// statNS identifies the namespace at path, which must be an nsfs file (a bind-mounted
// netns or /proc/<pid>/ns/net); a plain file (an unmounted leftover) is not one.
func statNS(path string) (nsID, error) {
	var sfs unix.Statfs_t
	if err := unix.Statfs(path, &sfs); err != nil {
		return nsID{}, err
	}
	if sfs.Type != unix.NSFS_MAGIC {
		return nsID{}, errNotNetns
	}
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return nsID{}, err
	}
	return nsID{uint64(st.Dev), st.Ino}, nil
}

// holds lists the namespace's addresses over a netlink socket opened in it (no thread
// of ours enters it beyond the socket's creation) and reports whether one of ips sits
// on a link that is not a loopback.
func holds(path string, ips map[netip.Addr]bool) (bool, error) {
	h, err := netns.GetFromPath(path)
	if err != nil {
		return false, fmt.Errorf("open: %w", err)
	}
	defer h.Close()
	nl, err := netlink.NewHandleAt(h, unix.NETLINK_ROUTE)
	if err != nil {
		return false, fmt.Errorf("netlink socket in netns: %w", err)
	}
	defer nl.Close()
	addrs, err := nl.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil {
		return false, fmt.Errorf("list addresses: %w", err)
	}
	for _, a := range addrs {
		if a.IPNet == nil {
			continue
		}
		ip, ok := netip.AddrFromSlice(a.IP)
		if !ok || !ips[ip.Unmap()] {
			continue
		}
		link, err := nl.LinkByIndex(a.LinkIndex)
		if err != nil {
			return false, fmt.Errorf("link %d: %w", a.LinkIndex, err)
		}
		if link.Attrs().Flags&net.FlagLoopback == 0 {
			return true, nil
		}
	}
	return false, nil
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

// FindPod finds the pod's network namespace from its status.podIPs. A hostNetwork
// pod is an error wrapping ErrHostNetwork, a pod without an IP one wrapping ErrNoPodIP.
func (f *Finder) FindPod(ctx context.Context, pod *corev1.Pod) (string, error) {
	if pod == nil {
		return "", errors.New("find netns: no pod")
	}
	if pod.Spec.HostNetwork {
		return "", fmt.Errorf("pod %s/%s: %w (it has no network namespace of its own)", pod.Namespace, pod.Name, ErrHostNetwork)
	}
	ips, err := PodIPs(pod)
	if err != nil {
		return "", err
	}
	if len(ips) == 0 {
		return "", fmt.Errorf("pod %s/%s: %w (phase %s)", pod.Namespace, pod.Name, ErrNoPodIP, pod.Status.Phase)
	}
	p, err := f.Find(ctx, ips)
	if err != nil {
		return "", fmt.Errorf("pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	return p, nil
}
