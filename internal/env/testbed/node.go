package testbed

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/vishvananda/netlink"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
)

// Node is a node of the test bed. Node 1 (NodeName) is the host itself; every
// other node runs its own containerd and kubelet in its own network and mount
// namespaces (see nodeplan.go for its addresses).
type Node struct {
	// Name is the Node object's name; IP its InternalIP; PodCIDR its pod range.
	Name    string
	IP      string
	PodCIDR string
	// StartupTime is how long an extra node took from its first process start
	// (containerd) to Ready; zero for node 1.
	StartupTime time.Duration

	tb            *Testbed
	plan          nodePlan // Index 0 for node 1
	labels        map[string]string
	containerdPID int
	containerd    *component // nil unless this process started the node
	kubelet       *component
}

// drainGrace caps the termination grace period of the pods a node removal evicts.
const drainGrace = 5

// Primary reports whether this is node 1, the host.
func (n *Node) Primary() bool { return n.plan.Index == 0 }

// CNIConfDir and CNIBinDir are the node's CNI directories as the host sees them
// (inside the node they are CNIConfDir and CNIBinDir).
func (n *Node) CNIConfDir() string {
	if n.Primary() {
		return CNIConfDir
	}
	return n.plan.cniConfDir()
}

// CNIBinDir: see CNIConfDir.
func (n *Node) CNIBinDir() string {
	if n.Primary() {
		return CNIBinDir
	}
	return n.plan.cniBinDir()
}

// DefaultPlugins is the node's reference chain (DefaultPlugins on its own range).
func (n *Node) DefaultPlugins() []map[string]any {
	if n.Primary() {
		return DefaultPlugins()
	}
	return n.plan.defaultPlugins()
}

// DefaultConflist is Conflist(n.DefaultPlugins()).
func (n *Node) DefaultConflist() []byte {
	b, err := Conflist(n.DefaultPlugins())
	if err != nil {
		panic(err) // static data
	}
	return b
}

// WriteConflist replaces the node's CNI configuration (WriteConflist for node 1).
func (n *Node) WriteConflist(data []byte) error { return writeConflistIn(n.CNIConfDir(), data) }

// InstallCNIPlugin installs a plugin binary into the node's CNIBinDir.
func (n *Node) InstallCNIPlugin(src, name string) error {
	return installPluginIn(n.CNIBinDir(), src, name)
}

// Netns is the node's network namespace (its host network) as a path.
func (n *Node) Netns() string {
	if n.Primary() {
		return "/proc/1/ns/net"
	}
	return n.plan.NetnsFile()
}

// HostPath is where the host sees path as the node sees it (through its
// containerd's root): pod network namespaces, containerd's state.
func (n *Node) HostPath(path string) string {
	if n.Primary() {
		return path
	}
	return fmt.Sprintf("/proc/%d/root%s", n.containerdPID, path)
}

func (n *Node) criSocket() string { return n.HostPath(containerdSocket) }

// Nodes lists the test bed's nodes, node 1 first.
func (tb *Testbed) Nodes() []*Node {
	out := []*Node{tb.primaryNode()}
	if !tb.owned {
		s, err := readState()
		if err != nil {
			return out
		}
		for _, ns := range s.Nodes {
			out = append(out, ns.node(tb))
		}
		return out
	}
	tb.mu.Lock()
	defer tb.mu.Unlock()
	return append(out, tb.nodes...)
}

// Node returns the node called name.
func (tb *Testbed) Node(name string) (*Node, error) {
	for _, n := range tb.Nodes() {
		if n.Name == name {
			return n, nil
		}
	}
	return nil, fmt.Errorf("testbed: no node %q", name)
}

func (tb *Testbed) primaryNode() *Node {
	return &Node{Name: NodeName, IP: NodeIP, PodCIDR: PodCIDR, tb: tb}
}

// AddNode joins a new node called name to the running cluster and returns once it
// is Ready, with the test bed's images imported. Through an attached test bed it
// asks the owner (`hack/testbed up`) to do it.
func (tb *Testbed) AddNode(ctx context.Context, name string) (*Node, error) {
	return tb.addNode(ctx, name, 0, NodeOptions{})
}

// NodeOptions configure AddNodeWith.
type NodeOptions struct {
	// Labels are the node's labels from its registration on (kubelet
	// --node-labels): a controller that selects nodes by label sees them on the
	// Node's first version.
	Labels map[string]string
}

// AddNodeWith is AddNode with options.
func (tb *Testbed) AddNodeWith(ctx context.Context, name string, o NodeOptions) (*Node, error) {
	return tb.addNode(ctx, name, 0, o)
}

// addNode adds a node at index (0: the lowest free one).
func (tb *Testbed) addNode(ctx context.Context, name string, index int, o NodeOptions) (*Node, error) {
	if tb.Mode != ModeFull {
		return nil, errors.New("testbed: nodes need a full test bed")
	}
	if !tb.owned {
		return controlAddNode(ctx, tb, name, o.Labels)
	}
	tb.mu.Lock()
	var used []int
	for _, n := range tb.nodes {
		if n.Name == name {
			tb.mu.Unlock()
			return nil, fmt.Errorf("testbed: node %q exists", name)
		}
		used = append(used, n.plan.Index)
	}
	idx, err := index, error(nil)
	if idx == 0 || slices.Contains(used, idx) {
		idx, err = freeIndex(used)
	}
	if err != nil {
		tb.mu.Unlock()
		return nil, err
	}
	plan, err := newNodePlan(name, idx)
	if err != nil {
		tb.mu.Unlock()
		return nil, err
	}
	n := &Node{Name: name, IP: plan.NodeIP(), PodCIDR: plan.PodCIDR(), tb: tb, plan: plan, labels: o.Labels}
	tb.nodes = append(tb.nodes, n)
	tb.mu.Unlock()
	if err := n.start(ctx); err != nil {
		tb.log.Error("node start failed; removing it", "node", name, "err", err)
		n.stopProcesses(context.WithoutCancel(ctx))
		terr := teardownNode(n.plan)
		tb.forget(n)
		return nil, errors.Join(err, terr)
	}
	_ = tb.writeState(true)
	return n, nil
}

func (tb *Testbed) forget(n *Node) {
	tb.mu.Lock()
	tb.nodes = slices.DeleteFunc(tb.nodes, func(m *Node) bool { return m == n })
	tb.mu.Unlock()
	_ = tb.writeState(true)
}

// start prepares the node's state, namespaces and cgroups, then starts its
// containerd and kubelet and waits until the node is Ready.
func (n *Node) start(ctx context.Context) error {
	p, tb := n.plan, n.tb
	if err := prepareNodeFiles(p, tb.Binaries); err != nil {
		return fmt.Errorf("node %s: %w", p.Name, err)
	}
	if err := ensureAPIEndpoint(); err != nil {
		return err
	}
	if err := ensureNodesRunDir(); err != nil {
		return err
	}
	if err := createNodeNetns(p); err != nil {
		return fmt.Errorf("node %s: %w", p.Name, err)
	}
	if err := createNodeMntns(ctx, p); err != nil {
		return fmt.Errorf("node %s: %w", p.Name, err)
	}
	if err := createNodeCgroups(p); err != nil {
		return fmt.Errorf("node %s: %w", p.Name, err)
	}
	began := time.Now()
	cdBin, err := exec.LookPath("containerd")
	if err != nil {
		return err
	}
	cd, err := n.startInNode("containerd", cdBin, "--config="+containerdConfigPath, "--log-level=info")
	if err != nil {
		return err
	}
	tb.mu.Lock()
	n.containerd, n.containerdPID = cd, cd.cmd.Process.Pid
	tb.mu.Unlock()
	_ = tb.writeState(false)
	if err := waitFor(ctx, cd, "containerd of node "+p.Name, func() error {
		out, err := exec.CommandContext(ctx, "ctr", "--address", n.criSocket(), "version").CombinedOutput()
		if err != nil {
			return fmt.Errorf("%w: %s", err, out)
		}
		return nil
	}); err != nil {
		return err
	}
	// Images before the kubelet: a pod scheduled onto the node as soon as it
	// registers (a DaemonSet's) would otherwise find its image missing
	// (pullPolicy Never) and wait out the kubelet's back-off.
	if err := n.importImages(ctx); err != nil {
		return err
	}
	args := []string{"--config=" + filepath.Join(p.Dir(), "kubelet.yaml"),
		"--kubeconfig=" + filepath.Join(p.Dir(), "kubelet.kubeconfig"),
		"--root-dir=" + kubeletDir, "--cert-dir=" + filepath.Join(kubeletDir, "pki"),
		"--hostname-override=" + p.Name, "--node-ip=" + p.NodeIP(), "--v=1"}
	if len(n.labels) > 0 {
		args = append(args, "--node-labels="+labelList(n.labels))
	}
	kl, err := n.startInNode("kubelet", tb.Binaries.Path("kubelet"), args...)
	if err != nil {
		return err
	}
	tb.mu.Lock()
	n.kubelet = kl
	tb.mu.Unlock()
	_ = tb.writeState(false)
	rerr := waitFor(ctx, kl, "node "+p.Name+" Ready", func() error { return nodeReady(ctx, tb.Client, p.Name) })
	tb.mu.Lock()
	n.StartupTime = time.Since(began)
	tb.mu.Unlock()
	if rerr != nil {
		return rerr
	}
	tb.log.Info("node ready", "node", p.Name, "ip", p.NodeIP(), "podCIDR", p.PodCIDR(), "took", n.StartupTime.Round(time.Millisecond))
	return nil
}

// labelList is labels as kubelet's --node-labels takes them: k=v,k=v, sorted.
func labelList(labels map[string]string) string {
	var kv []string
	for k, v := range labels {
		kv = append(kv, k+"="+v)
	}
	slices.Sort(kv)
	return strings.Join(kv, ",")
}

// startInNode starts a daemon inside the node's namespaces (nsenter, which
// execs it: the component's pid is the daemon's).
func (n *Node) startInNode(what, bin string, args ...string) (*component, error) {
	ns := []string{"--net=" + n.plan.NetnsFile(), "--mount=" + n.plan.MntnsFile(), "--", bin}
	return startComponent("node-"+n.plan.Name+"-"+what, "nsenter", append(ns, args...)...)
}

// importImages imports into the node every archive the test bed imported so far,
// in parallel.
func (n *Node) importImages(ctx context.Context) error {
	archives := append([]string{n.tb.Binaries.ImagesArchive()}, importedArchives()...)
	slices.Sort(archives)
	archives = slices.Compact(archives)
	errs := make([]error, len(archives))
	var wg sync.WaitGroup
	for i, a := range archives {
		wg.Go(func() {
			if err := importInto(ctx, n.criSocket(), a); err != nil {
				errs[i] = fmt.Errorf("node %s: %w", n.Name, err)
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

func nodeReady(ctx context.Context, cs kubernetes.Interface, name string) error {
	node, err := cs.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return err
	}
	for _, c := range node.Status.Conditions {
		if c.Type == corev1.NodeReady && c.Status == corev1.ConditionTrue {
			return nil
		}
	}
	return errors.New("node not Ready")
}

// Remove drains the node (cordon, evict its pods but DaemonSets'), stops its
// kubelet, removes its pod sandboxes through CRI, stops its containerd, deletes
// the Node object and the pods still bound to it, and removes every trace of it.
// Node 1 cannot be removed.
func (n *Node) Remove(ctx context.Context) error {
	if n.Primary() {
		return errors.New("testbed: node 1 cannot be removed (Stop the test bed)")
	}
	if !n.tb.owned {
		return controlRemoveNode(ctx, n.Name)
	}
	began := time.Now()
	var errs []error
	if n.kubelet != nil && !n.kubelet.exited() {
		if err := n.drain(ctx); err != nil {
			errs = append(errs, err)
		}
	}
	n.stopProcesses(ctx)
	cs := n.tb.Client
	if err := cs.CoreV1().Nodes().Delete(ctx, n.Name, metav1.DeleteOptions{}); ignoreNotFound(err) != nil {
		errs = append(errs, fmt.Errorf("delete node %s: %w", n.Name, err))
	}
	if err := deletePodsOn(ctx, cs, n.Name, func(corev1.Pod) bool { return true }, 0); err != nil {
		errs = append(errs, err)
	}
	if err := teardownNode(n.plan); err != nil {
		errs = append(errs, err)
	}
	n.tb.forget(n)
	n.tb.log.Info("node removed", "node", n.Name, "took", time.Since(began).Round(time.Millisecond))
	return errors.Join(errs...)
}

// Kill makes the node die abruptly: its kubelet, containerd, shims and pods (all
// of its cgroup tree) get SIGKILL and its link to the host is deleted. The Node object stays (it goes
// NotReady once its lease expires); Remove then deletes it and its pods and
// removes its traces.
func (n *Node) Kill() error {
	if n.Primary() || !n.tb.owned {
		return errors.New("testbed: Kill needs an extra node of a test bed this process started")
	}
	match := nodeMember(n.plan)
	for _, p := range ourProcesses() {
		if match(p) {
			_ = syscall.Kill(p.pid, syscall.SIGKILL)
		}
	}
	for _, c := range []*component{n.kubelet, n.containerd} {
		if c != nil {
			c.stop(0)
		}
	}
	killCgroupProcs(nodeCgroupDirs(n.Name))
	if l, err := netlink.LinkByName(n.plan.HostVeth()); err == nil {
		if err := netlink.LinkDel(l); err != nil {
			return fmt.Errorf("delete %s: %w", n.plan.HostVeth(), err)
		}
	}
	return nil
}

// drain cordons the node and evicts its pods (DaemonSets' excepted), waiting
// until they are gone.
func (n *Node) drain(ctx context.Context) error {
	cs := n.tb.Client
	patch := []byte(`{"spec":{"unschedulable":true}}`)
	if _, err := cs.CoreV1().Nodes().Patch(ctx, n.Name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		return fmt.Errorf("cordon %s: %w", n.Name, err)
	}
	dctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	evictable := func(p corev1.Pod) bool {
		for _, o := range p.OwnerReferences {
			if o.Kind == "DaemonSet" {
				return false
			}
		}
		return p.Annotations[corev1.MirrorPodAnnotationKey] == ""
	}
	return poll(dctx, 200*time.Millisecond, func() error {
		return deletePodsOn(dctx, cs, n.Name, evictable, -1)
	})
}

// deletePodsOn evicts (grace < 0: with drainGrace) or deletes with grace seconds
// the pods bound to node that match; it returns an error while any is left.
func deletePodsOn(ctx context.Context, cs kubernetes.Interface, node string, match func(corev1.Pod) bool, grace int64) error {
	pods, err := cs.CoreV1().Pods("").List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + node})
	if err != nil {
		return fmt.Errorf("pods on %s: %w", node, err)
	}
	var left []string
	for _, p := range pods.Items {
		if !match(p) {
			continue
		}
		left = append(left, p.Namespace+"/"+p.Name)
		if grace < 0 {
			g := int64(drainGrace)
			if p.Spec.TerminationGracePeriodSeconds != nil && *p.Spec.TerminationGracePeriodSeconds < g {
				g = *p.Spec.TerminationGracePeriodSeconds
			}
			ev := &policyv1.Eviction{ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: p.Namespace},
				DeleteOptions: &metav1.DeleteOptions{GracePeriodSeconds: &g}}
			_ = cs.PolicyV1().Evictions(p.Namespace).Evict(ctx, ev)
			continue
		}
		if err := cs.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{GracePeriodSeconds: &grace}); ignoreNotFound(err) != nil {
			return fmt.Errorf("delete pod %s/%s: %w", p.Namespace, p.Name, err)
		}
	}
	if len(left) > 0 && grace < 0 {
		return fmt.Errorf("pods left on %s: %s", node, strings.Join(left, ", "))
	}
	return nil
}

// stopProcesses stops the node's kubelet, removes its pod sandboxes through CRI
// and stops its containerd.
func (n *Node) stopProcesses(ctx context.Context) {
	if n.kubelet != nil {
		n.kubelet.stop(10 * time.Second)
	}
	if n.containerd != nil && !n.containerd.exited() {
		if err := removePodsAt(ctx, n.tb.log, n.criSocket(), n.CNIConfDir(), n.DefaultConflist()); err != nil {
			n.tb.log.Warn("removing the node's pods through CRI failed", "node", n.Name, "err", err)
		}
		n.containerd.stop(10 * time.Second)
	}
}

// nodeState is a node as recorded in the state file.
type nodeState struct {
	Name          string `json:"name"`
	Index         int    `json:"index"`
	ContainerdPID int    `json:"containerdPID,omitempty"`
	KubeletPID    int    `json:"kubeletPID,omitempty"`
	StartupMs     int64  `json:"startupMs,omitempty"`
}

func (n *Node) state() nodeState {
	s := nodeState{Name: n.Name, Index: n.plan.Index, ContainerdPID: n.containerdPID, StartupMs: n.StartupTime.Milliseconds()}
	if n.kubelet != nil {
		s.KubeletPID = n.kubelet.cmd.Process.Pid
	}
	return s
}

func (s nodeState) node(tb *Testbed) *Node {
	p := nodePlan{Name: s.Name, Index: s.Index}
	return &Node{Name: s.Name, IP: p.NodeIP(), PodCIDR: p.PodCIDR(), tb: tb, plan: p,
		containerdPID: s.ContainerdPID, StartupTime: time.Duration(s.StartupMs) * time.Millisecond}
}

// runningNodes are the extra nodes of the state file whose containerd is alive.
func runningNodes() []*Node {
	s, err := readState()
	if err != nil {
		return nil
	}
	var out []*Node
	for _, ns := range s.Nodes {
		if pidAlive(ns.ContainerdPID) {
			out = append(out, ns.node(nil))
		}
	}
	return out
}

// nodeOfPod is the node a pod is bound to (node 1 when unknown).
func (tb *Testbed) nodeOfPod(p *corev1.Pod) *Node {
	if p.Spec.NodeName != "" && p.Spec.NodeName != NodeName {
		if n, err := tb.Node(p.Spec.NodeName); err == nil {
			return n
		}
	}
	return tb.primaryNode()
}

// importsFile lists the archives ImportImage imported, one per line, so nodes
// added later import them too.
var importsFile = filepath.Join(RunDir, "imported-images")

func recordImport(archive string) {
	abs, err := filepath.Abs(archive)
	if err != nil {
		return
	}
	if slices.Contains(importedArchives(), abs) {
		return
	}
	f, err := os.OpenFile(importsFile, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return
	}
	defer f.Close()
	_, _ = f.WriteString(abs + "\n")
}

func importedArchives() []string {
	b, err := os.ReadFile(importsFile)
	if err != nil {
		return nil
	}
	return strings.Fields(string(b))
}
