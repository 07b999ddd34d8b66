package testbed

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// cleanup removes every trace of a test bed whatever state it is in: it is what
// Stop ends with and what Down and Start run after a crash.
func cleanup(ctx context.Context, log *slog.Logger) error {
	var errs []error
	procs := ourProcesses()
	if len(procs) > 0 {
		// Orderly first when a containerd survived its owner: stop the control
		// loops, remove the pods through CRI (CNI DEL, shims reap their children),
		// then kill what is left.
		names := map[string]bool{}
		for _, p := range procs {
			names[p.comm] = true
		}
		log.Info("cleaning up leftover test bed processes", "count", len(procs))
		killMatching(func(p procInfo) bool {
			return strings.HasPrefix(p.comm, "kube-") || p.comm == "kubelet"
		}, 10*time.Second)
		if names["containerd"] {
			for _, t := range criTargets(procs) {
				if err := removePodsAt(ctx, log, t.sock, t.confDir, t.conf); err != nil {
					log.Warn("removing pods through CRI failed; killing them", "containerd", t.sock, "err", err)
				}
			}
		}
		// Pods' processes (descendants of the shims) before the shims, the shims
		// before containerd, so each dies under a parent that reaps it.
		killMatching(func(p procInfo) bool { return !strings.HasPrefix(p.comm, "containerd") && p.comm != "etcd" }, 5*time.Second)
		killMatching(func(p procInfo) bool { return strings.HasPrefix(p.comm, "containerd-shim") }, 5*time.Second)
		killMatching(func(procInfo) bool { return true }, 10*time.Second)
		if left := ourProcesses(); len(left) > 0 {
			errs = append(errs, fmt.Errorf("processes still running: %v", describe(left)))
		}
	}
	// Extra nodes were used: their links, and the API server's DNAT (only
	// installed for them, so a one-node test bed does not pay for its removal).
	_, err := os.Stat(nodesDir)
	nodesUsed := err == nil
	if err := unmountUnder(BaseDir, RunDir); err != nil {
		errs = append(errs, err)
	}
	if err := removeHostBPFFS(); err != nil {
		errs = append(errs, err)
	}
	if err := restoreHostSysctls(); err != nil {
		errs = append(errs, err)
	}
	for _, l := range nodeLinks() {
		if err := removeLink(l); err != nil {
			errs = append(errs, err)
		}
	}
	if nodesUsed {
		removeAPIEndpoint()
	}
	for _, d := range []string{BaseDir, RunDir} {
		if err := os.RemoveAll(d); err != nil {
			errs = append(errs, fmt.Errorf("remove %s: %w", d, err))
		}
	}
	if l, err := netlink.LinkByName(BridgeName); err == nil {
		if err := netlink.LinkDel(l); err != nil {
			errs = append(errs, fmt.Errorf("delete bridge %s: %w", BridgeName, err))
		}
	}
	killCgroupProcs(nodeCgroupDirs(""))
	if err := removeCgroups(); err != nil {
		errs = append(errs, err)
	}
	removePortmapChains()
	return errors.Join(errs...)
}

// criTarget is a containerd to remove pods through, and the CNI configuration
// to restore if CNI DEL fails.
type criTarget struct {
	sock, confDir string
	conf          []byte
}

// criTargets are the live containerds among procs: node 1's, and each extra
// node's as the host sees its socket.
func criTargets(procs []procInfo) []criTarget {
	byPID := map[int]nodeState{}
	if s, err := readState(); err == nil {
		for _, n := range s.Nodes {
			byPID[n.ContainerdPID] = n
		}
	}
	self := inode("/proc/self/ns/mnt")
	var out []criTarget
	for _, p := range procs {
		if p.comm != "containerd" {
			continue
		}
		if inode(fmt.Sprintf("/proc/%d/ns/mnt", p.pid)) == self {
			out = append(out, criTarget{containerdSocket, CNIConfDir, DefaultConflist()})
			continue
		}
		t := criTarget{sock: fmt.Sprintf("/proc/%d/root%s", p.pid, containerdSocket)}
		if ns, ok := byPID[p.pid]; ok {
			n := ns.node(nil)
			t.confDir, t.conf = n.CNIConfDir(), n.DefaultConflist()
		}
		out = append(out, t)
	}
	return out
}

func describe(ps []procInfo) []string {
	var out []string
	for _, p := range ps {
		out = append(out, fmt.Sprintf("%d(%s)", p.pid, p.comm))
	}
	return out
}

// killMatching sends SIGTERM to the matching processes of ourProcesses, then
// SIGKILL after grace, and waits until they are gone (or reaped).
func killMatching(match func(procInfo) bool, grace time.Duration) {
	sel := func() []procInfo {
		var out []procInfo
		for _, p := range ourProcesses() {
			if match(p) {
				out = append(out, p)
			}
		}
		return out
	}
	ps := sel()
	if len(ps) == 0 {
		return
	}
	for _, p := range ps {
		_ = unix.Kill(p.pid, unix.SIGTERM)
	}
	deadline := time.Now().Add(grace)
	for time.Now().Before(deadline) {
		reapOrphans()
		if len(sel()) == 0 {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	for _, p := range sel() {
		_ = unix.Kill(p.pid, unix.SIGKILL)
	}
	deadline = time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) && len(sel()) > 0 {
		reapOrphans()
		time.Sleep(50 * time.Millisecond)
	}
}

// mountsUnder lists mount points below any of dirs (and dirs themselves), deepest
// first.
func mountsUnder(dirs ...string) ([]string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 {
			continue
		}
		mp := unescapeMount(fields[4])
		for _, d := range dirs {
			if mp == d || strings.HasPrefix(mp, d+"/") {
				out = append(out, mp)
				break
			}
		}
	}
	sort.Slice(out, func(i, j int) bool { return len(out[i]) > len(out[j]) })
	return out, sc.Err()
}

func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	r := strings.NewReplacer(`\040`, " ", `\011`, "\t", `\012`, "\n", `\134`, `\`)
	return r.Replace(s)
}

func unmountUnder(dirs ...string) error {
	for range 5 {
		mps, err := mountsUnder(dirs...)
		if err != nil {
			return err
		}
		if len(mps) == 0 {
			return nil
		}
		for _, mp := range mps {
			_ = unix.Unmount(mp, unix.MNT_DETACH)
		}
	}
	mps, _ := mountsUnder(dirs...)
	if len(mps) > 0 {
		return fmt.Errorf("mounts left: %v", mps)
	}
	return nil
}

// cgroupRoots are the kubelet's cgroup trees (cgroupfs driver) in every mounted
// hierarchy.
func cgroupRoots() []string {
	var out []string
	for _, pat := range []string{"/sys/fs/cgroup/*/kubepods", "/sys/fs/cgroup/kubepods"} {
		m, _ := filepath.Glob(pat)
		out = append(out, m...)
	}
	return append(out, nodeCgroupDirs("")...)
}

func removeCgroups() error { return removeCgroupTrees(cgroupRoots()) }

// removeCgroupTrees removes each cgroup directory of roots, depth first.
func removeCgroupTrees(roots []string) error {
	var left []string
	for _, root := range roots {
		var dirs []string
		_ = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		sort.Slice(dirs, func(i, j int) bool { return len(dirs[i]) > len(dirs[j]) })
		for _, d := range dirs {
			var err error
			for range 20 {
				if err = unix.Rmdir(d); err == nil || errors.Is(err, unix.ENOENT) {
					err = nil
					break
				}
				time.Sleep(50 * time.Millisecond)
			}
			if err != nil {
				left = append(left, d+": "+err.Error())
			}
		}
	}
	if len(left) > 0 {
		return fmt.Errorf("cgroups left: %v", left)
	}
	return nil
}

// Leftovers lists what a stopped test bed must not leave behind: live processes,
// mounts, the bridge, kubepods cgroups, state directories and containerd's
// network namespaces. Empty means clean.
func Leftovers() []string {
	var out []string
	if ps := ourProcesses(); len(ps) > 0 {
		out = append(out, fmt.Sprintf("processes: %v", describe(ps)))
	}
	reapOrphans()
	for _, p := range listProcs() {
		if p.ppid == os.Getpid() && p.state == 'Z' && hasPrefixAny(p.comm, reapComms) {
			out = append(out, fmt.Sprintf("zombie: %d(%s)", p.pid, p.comm))
		}
	}
	if mps, _ := mountsUnder(BaseDir, RunDir); len(mps) > 0 {
		out = append(out, fmt.Sprintf("mounts: %v", mps))
	}
	if _, err := netlink.LinkByName(BridgeName); err == nil {
		out = append(out, "bridge "+BridgeName)
	}
	if cg := cgroupRoots(); len(cg) > 0 {
		out = append(out, fmt.Sprintf("cgroups: %v", cg))
	}
	for _, d := range []string{BaseDir, RunDir} {
		if _, err := os.Stat(d); err == nil {
			out = append(out, "directory "+d)
		}
	}
	if hostBPFFSLeft() {
		out = append(out, "the bpffs the test bed mounted at "+HostBPFFS)
	}
	if links := nodeLinks(); len(links) > 0 {
		out = append(out, fmt.Sprintf("node links: %v", links))
	}
	if apiEndpointPresent() {
		out = append(out, "iptables nat DNAT rule "+apiDNATComment)
	}
	if present, _ := portmapChainsPresent(); present {
		out = append(out, "iptables nat chain CNI-HOSTPORT-DNAT")
	}
	return out
}
