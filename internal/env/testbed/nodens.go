package testbed

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/pkg/netnsutil"
)

// prepareNodeFiles writes the node's directories, certificates, kubeconfig,
// kubelet configuration, CNI plugins and configuration.
func prepareNodeFiles(p nodePlan, bins Binaries) error {
	for _, d := range []string{"cni/net.d", "cni/bin", "cni/ipam", "kubelet", "containerd", "pod-logs", "pki"} {
		if err := os.MkdirAll(filepath.Join(p.Dir(), d), 0o755); err != nil {
			return err
		}
	}
	ca, err := loadPKI()
	if err != nil {
		return fmt.Errorf("load the test bed's CA: %w", err)
	}
	pdir := filepath.Join(p.Dir(), "pki")
	for _, s := range p.certs() {
		if err := ca.issueIn(pdir, s); err != nil {
			return fmt.Errorf("issue %s certificate: %w", s.file, err)
		}
	}
	if err := ca.writeKubeconfigFor(filepath.Join(p.Dir(), "kubelet.kubeconfig"), pdir, "kubelet", ClusterAPIServerHost); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(p.Dir(), "kubelet.yaml"), []byte(p.kubeletConfig()), 0o644); err != nil {
		return err
	}
	for name := range cniPlugins {
		if err := installPluginIn(p.cniBinDir(), filepath.Join(bins.CNIPluginDir(), name), name); err != nil {
			return err
		}
	}
	conf, err := Conflist(p.defaultPlugins())
	if err != nil {
		return err
	}
	return writeConflistIn(p.cniConfDir(), conf)
}

// apiDNAT are the rules that expose the API server (127.0.0.1:6443) on NodeIP to
// the host (OUTPUT) and to nodes and pods (PREROUTING, with route_localnet on the
// incoming link).
func apiDNAT(op string) [][]string {
	var out [][]string
	for _, chain := range []string{"PREROUTING", "OUTPUT"} {
		out = append(out, []string{"-w", "-t", "nat", op, chain, "-d", NodeIP + "/32", "-p", "tcp",
			"--dport", strconv.Itoa(APIServerPort), "-m", "comment", "--comment", apiDNATComment,
			"-j", "DNAT", "--to-destination", net.JoinHostPort(APIServerHost, strconv.Itoa(APIServerPort))})
	}
	return out
}

// ensureAPIEndpoint installs apiDNAT once and lets pods of node 1 use it.
func ensureAPIEndpoint() error {
	adds := apiDNAT("-A")
	for i, r := range apiDNAT("-C") {
		if exec.Command("iptables", r...).Run() == nil {
			continue
		}
		add := adds[i]
		if out, err := exec.Command("iptables", add...).CombinedOutput(); err != nil {
			return fmt.Errorf("iptables %v: %w: %s", add, err, out)
		}
	}
	return setRouteLocalnet(BridgeName)
}

func setRouteLocalnet(link string) error {
	p := filepath.Join("/proc/sys/net/ipv4/conf", link, "route_localnet")
	if err := os.WriteFile(p, []byte("1"), 0o644); err != nil {
		return fmt.Errorf("route_localnet on %s: %w", link, err)
	}
	return nil
}

// removeAPIEndpoint deletes apiDNAT (every copy).
func removeAPIEndpoint() {
	for _, r := range apiDNAT("-D") {
		for range 5 {
			if exec.Command("iptables", r...).Run() != nil {
				break
			}
		}
	}
}

func apiEndpointPresent() bool {
	for _, r := range apiDNAT("-C") {
		if exec.Command("iptables", r...).Run() == nil {
			return true
		}
	}
	return false
}

// createNodeNetns creates the node's network namespace (bound to NetnsFile), its
// veth to the host, addresses, default route and the host's route to its pods.
func createNodeNetns(p nodePlan) error {
	if err := bindNewNetns(p.NetnsFile()); err != nil {
		return err
	}
	peerName := "mcnp" + strconv.Itoa(p.Index)
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: p.HostVeth()}, PeerName: peerName}
	if err := netlink.LinkAdd(veth); err != nil {
		return fmt.Errorf("create veth %s: %w", p.HostVeth(), err)
	}
	peer, err := netlink.LinkByName(peerName)
	if err != nil {
		return err
	}
	fd, err := netnsutil.Open(p.NetnsFile())
	if err != nil {
		return err
	}
	err = netlink.LinkSetNsFd(peer, fd)
	unix.Close(fd)
	if err != nil {
		return fmt.Errorf("move %s into the node: %w", peerName, err)
	}
	host, err := netlink.LinkByName(p.HostVeth())
	if err != nil {
		return err
	}
	if err := addrUp(host, p.HostIP()+"/24"); err != nil {
		return err
	}
	if err := setRouteLocalnet(p.HostVeth()); err != nil {
		return err
	}
	if err := netnsutil.Do(p.NetnsFile(), func() error { return configureNodeSide(p, peerName) }); err != nil {
		return fmt.Errorf("configure the node's network: %w", err)
	}
	_, pods, _ := net.ParseCIDR(p.PodCIDR())
	if err := netlink.RouteAdd(&netlink.Route{Dst: pods, Gw: net.ParseIP(p.NodeIP()), LinkIndex: host.Attrs().Index}); err != nil {
		return fmt.Errorf("route %s via %s: %w", p.PodCIDR(), p.NodeIP(), err)
	}
	// The host routes between the nodes, as a cluster's network does (Start recorded
	// the host's setting; cleanup puts it back).
	if err := os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("1"), 0o644); err != nil {
		return fmt.Errorf("host forwarding between nodes: %w", err)
	}
	return nil
}

// bindNewNetns creates a network namespace and binds it to path, on a thread
// that dies with it (never returned to the scheduler).
func bindNewNetns(path string) error {
	if err := os.WriteFile(path, nil, 0o644); err != nil {
		return err
	}
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("unshare netns: %w", err)
			return
		}
		src := fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid())
		if err := unix.Mount(src, path, "", unix.MS_BIND, ""); err != nil {
			errc <- fmt.Errorf("bind netns to %s: %w", path, err)
			return
		}
		errc <- nil
	}()
	return <-errc
}

// configureNodeSide runs inside the node's network namespace.
func configureNodeSide(p nodePlan, peerName string) error {
	lo, err := netlink.LinkByName("lo")
	if err != nil {
		return err
	}
	if err := netlink.LinkSetUp(lo); err != nil {
		return err
	}
	eth, err := netlink.LinkByName(peerName)
	if err != nil {
		return err
	}
	if err := netlink.LinkSetName(eth, "eth0"); err != nil {
		return err
	}
	if err := addrUp(eth, p.NodeIP()+"/24"); err != nil {
		return err
	}
	if err := netlink.RouteAdd(&netlink.Route{Gw: net.ParseIP(p.HostIP()), LinkIndex: eth.Attrs().Index}); err != nil {
		return fmt.Errorf("default route via %s: %w", p.HostIP(), err)
	}
	return os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("1"), 0o644)
}

func addrUp(l netlink.Link, cidr string) error {
	a, err := netlink.ParseAddr(cidr)
	if err != nil {
		return err
	}
	if err := netlink.AddrAdd(l, a); err != nil {
		return fmt.Errorf("address %s on %s: %w", cidr, l.Attrs().Name, err)
	}
	if err := netlink.LinkSetUp(l); err != nil {
		return fmt.Errorf("bring up %s: %w", l.Attrs().Name, err)
	}
	return nil
}

// ensureNodesRunDir makes nodesRunDir a private bind mount: namespace files can
// only be bound on a private mount, and RunDir is shared.
func ensureNodesRunDir() error {
	if mps, _ := mountsUnder(nodesRunDir); slices.Contains(mps, nodesRunDir) {
		return nil
	}
	if err := os.MkdirAll(nodesRunDir, 0o755); err != nil {
		return err
	}
	if err := unix.Mount(nodesRunDir, nodesRunDir, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind %s: %w", nodesRunDir, err)
	}
	if err := unix.Mount("", nodesRunDir, "", unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make %s private: %w", nodesRunDir, err)
	}
	return nil
}

// createNodeMntns creates the node's mount namespace (a slave of the host's,
// bound to MntnsFile): the test bed's mounts are detached there, RunDir is a
// fresh shared tmpfs, and the node's directories are bound over the test bed's
// (binds), so hostPath volumes and the CNI dirs are the node's own.
func createNodeMntns(ctx context.Context, p nodePlan) error {
	f := p.MntnsFile()
	if err := os.WriteFile(f, nil, 0o644); err != nil {
		return err
	}
	if err := run(ctx, "unshare", "--mount="+f, "--propagation", "slave", "true"); err != nil {
		return err
	}
	mps, err := mountsUnder(BaseDir, RunDir)
	if err != nil {
		return err
	}
	if tops := topmost(mps); len(tops) > 0 {
		if err := run(ctx, "nsenter", append([]string{"--mount=" + f, "umount", "-l"}, tops...)...); err != nil {
			return err
		}
	}
	steps := [][]string{
		{"mount", "-t", "tmpfs", "-o", "mode=0755,size=4g", "tmpfs", RunDir},
		{"mount", "--make-rshared", RunDir},
	}
	for _, b := range p.binds() {
		steps = append(steps, []string{"mount", "--bind", b[0], b[1]})
	}
	for _, s := range steps {
		if err := run(ctx, "nsenter", append([]string{"--mount=" + f}, s...)...); err != nil {
			return err
		}
	}
	return nil
}

// topmost keeps the mount points not below another one of mps.
func topmost(mps []string) []string {
	sort.Strings(mps)
	var out []string
	for _, m := range mps {
		if len(out) > 0 && (m == out[len(out)-1] || strings.HasPrefix(m, out[len(out)-1]+"/")) {
			continue
		}
		out = append(out, m)
	}
	return out
}

func run(ctx context.Context, prog string, args ...string) error {
	out, err := exec.CommandContext(ctx, prog, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %w: %s", prog, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// createNodeCgroups creates the kubelet's cgroup root in nodeCgroupControllers
// (cpuset with its parent's cpus and mems).
func createNodeCgroups(p nodePlan) error {
	for _, c := range nodeCgroupControllers {
		d := filepath.Join("/sys/fs/cgroup", c, p.CgroupRoot())
		if err := os.MkdirAll(d, 0o755); err != nil {
			return fmt.Errorf("cgroup %s: %w", d, err)
		}
		if c != "cpuset" {
			continue
		}
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			b, err := os.ReadFile(filepath.Join("/sys/fs/cgroup/cpuset", f))
			if err != nil {
				return err
			}
			if err := os.WriteFile(filepath.Join(d, f), b, 0o644); err != nil {
				return fmt.Errorf("%s/%s: %w", d, f, err)
			}
		}
	}
	return nil
}

// teardownNode removes every trace of an extra node once its daemons are stopped:
// what is left of its processes, its namespaces (and with the network namespace
// its veth and the host's route), its cgroups and its directory.
func teardownNode(p nodePlan) error {
	var errs []error
	killMatching(nodeMember(p), 5*time.Second)
	for _, f := range []string{p.NetnsFile(), p.MntnsFile()} {
		_ = unix.Unmount(f, unix.MNT_DETACH)
		if err := os.Remove(f); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	if err := removeLink(p.HostVeth()); err != nil {
		errs = append(errs, err)
	}
	killCgroupProcs(nodeCgroupDirs(p.Name))
	if err := removeCgroupTrees(nodeCgroupDirs(p.Name)); err != nil {
		errs = append(errs, err)
	}
	if err := unmountUnder(p.Dir()); err != nil {
		errs = append(errs, err)
	}
	if err := os.RemoveAll(p.Dir()); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// removeLink waits for a node's host veth to go with its namespace, deleting it
// if it stays.
func removeLink(name string) error {
	deadline := time.Now().Add(3 * time.Second)
	for time.Now().Before(deadline) {
		if _, err := netlink.LinkByName(name); err != nil {
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	l, err := netlink.LinkByName(name)
	if err != nil {
		return nil
	}
	if err := netlink.LinkDel(l); err != nil {
		return fmt.Errorf("delete %s: %w", name, err)
	}
	return nil
}

// nodeMember matches the processes of an extra node: those in its network or
// mount namespace, and (through ourProcesses) their descendants' roots.
func nodeMember(p nodePlan) func(procInfo) bool {
	netIno, mntIno := inode(p.NetnsFile()), inode(p.MntnsFile())
	return func(pi procInfo) bool {
		if netIno == 0 && mntIno == 0 {
			return false
		}
		for _, ns := range []struct {
			kind string
			ino  uint64
		}{{"net", netIno}, {"mnt", mntIno}} {
			if ns.ino != 0 && inode(fmt.Sprintf("/proc/%d/ns/%s", pi.pid, ns.kind)) == ns.ino {
				return true
			}
		}
		return descendsFrom(pi.pid, netIno, mntIno)
	}
}

// descendsFrom reports whether an ancestor of pid is in one of the namespaces.
func descendsFrom(pid int, netIno, mntIno uint64) bool {
	for range 64 {
		pp := ppidOf(pid)
		if pp <= 1 {
			return false
		}
		if (netIno != 0 && inode(fmt.Sprintf("/proc/%d/ns/net", pp)) == netIno) ||
			(mntIno != 0 && inode(fmt.Sprintf("/proc/%d/ns/mnt", pp)) == mntIno) {
			return true
		}
		pid = pp
	}
	return false
}

func ppidOf(pid int) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	s := string(b)
	r := strings.LastIndexByte(s, ')')
	if r < 0 {
		return 0
	}
	f := strings.Fields(s[r+1:])
	if len(f) < 2 {
		return 0
	}
	n, _ := strconv.Atoi(f[1])
	return n
}

func inode(path string) uint64 {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return 0
	}
	return st.Ino
}

// nodeCgroupDirs are a node's cgroup roots in every mounted hierarchy (name ""
// for every node's).
func nodeCgroupDirs(name string) []string {
	pat := "/sys/fs/cgroup/*/" + nodeCgroupPrefix + name
	if name == "" {
		pat += "*"
	}
	m, _ := filepath.Glob(pat)
	return m
}

// nodeLinks are the host sides of the extra nodes' veths still present.
func nodeLinks() []string {
	links, err := netlink.LinkList()
	if err != nil {
		return nil
	}
	var out []string
	for _, l := range links {
		if strings.HasPrefix(l.Attrs().Name, nodeVethPrefix) {
			out = append(out, l.Attrs().Name)
		}
	}
	return out
}

// killCgroupProcs SIGKILLs every process in the cgroup trees of roots (a node's
// pods, whoever their parent is now) and waits until they are gone, reaping those
// re-parented to this process.
func killCgroupProcs(roots []string) {
	for range 50 {
		pids := cgroupProcs(roots)
		if len(pids) == 0 {
			return
		}
		for _, pid := range pids {
			_ = unix.Kill(pid, unix.SIGKILL)
		}
		time.Sleep(50 * time.Millisecond)
		reapChildren(pids)
	}
}

func cgroupProcs(roots []string) []int {
	seen := map[int]bool{}
	var out []int
	for _, root := range roots {
		_ = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() || d.Name() != "cgroup.procs" {
				return nil
			}
			b, _ := os.ReadFile(p)
			for _, f := range strings.Fields(string(b)) {
				if pid, err := strconv.Atoi(f); err == nil && !seen[pid] {
					seen[pid] = true
					out = append(out, pid)
				}
			}
			return nil
		})
	}
	return out
}

// reapChildren waits for those of pids that are zombie children of this process
// and not started through exec.Cmd.
func reapChildren(pids []int) {
	self := os.Getpid()
	for _, pid := range pids {
		managedMu.Lock()
		mine := managed[pid]
		managedMu.Unlock()
		if mine || ppidOf(pid) != self {
			continue
		}
		var ws unix.WaitStatus
		_, _ = unix.Wait4(pid, &ws, unix.WNOHANG, nil)
	}
}
