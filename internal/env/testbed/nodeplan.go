package testbed

import (
	"fmt"
	"path/filepath"
	"regexp"
	"strconv"
)

// Extra nodes: node k (2 ≤ k ≤ MaxNodes) lives in its own network and mount
// namespaces. Its link to the host is a veth pair in 10.216.k.0/24 (host side
// .1, node side .2, the node IP); its pods get 10.215.k.0/24 on a bridge named
// BridgeName inside its network namespace. The host routes each node's pod range
// via the node IP, so pods reach each other by pod IP across nodes without NAT.
const (
	// MaxNodes bounds the nodes of one test bed (node 1 included).
	MaxNodes = 16
	// NodesPodRange holds the extra nodes' pod ranges (10.215.k.0/24 for node k).
	NodesPodRange = "10.215.0.0/16"
	// NodesLinkRange holds the extra nodes' links to the host (10.216.k.0/24).
	NodesLinkRange = "10.216.0.0/16"
	// ClusterAPIServerHost is where every node and pod reaches the API server
	// once a second node exists: node 1's address, DNATed to 127.0.0.1:6443.
	ClusterAPIServerHost = NodeIP

	// nodeVethPrefix names the host side of a node's veth (mcnv<k>).
	nodeVethPrefix = "mcnv"
	// nodeCgroupPrefix names a node's kubelet cgroup root (/meshcni-node-<name>)
	// in every hierarchy.
	nodeCgroupPrefix = "meshcni-node-"
	// apiDNATComment marks the DNAT rules that expose the API server on NodeIP.
	apiDNATComment = "meshcni-testbed-apiserver"
)

var (
	// nodesDir holds each extra node's persistent state (BaseDir/nodes/<name>).
	nodesDir = filepath.Join(BaseDir, "nodes")
	// nodesRunDir holds the files the nodes' namespaces are bound to; a private
	// bind mount, so the namespace files can be bound there.
	nodesRunDir = filepath.Join(RunDir, "nodes")
	// nodeCgroupControllers are the hierarchies a node's cgroup root is created
	// in before its kubelet starts.
	nodeCgroupControllers = []string{"systemd", "cpu", "cpuacct", "cpuset", "memory", "pids"}
	nodeNameRE            = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$`)
)

// nodePlan is everything fixed about an extra node by its name and index.
type nodePlan struct {
	Name  string
	Index int
}

func newNodePlan(name string, index int) (nodePlan, error) {
	if !nodeNameRE.MatchString(name) {
		return nodePlan{}, fmt.Errorf("node name %q: want a DNS label of at most 40 characters (lower-case letters, digits, '-')", name)
	}
	if name == NodeName {
		return nodePlan{}, fmt.Errorf("node name %q is node 1's", name)
	}
	if index < 2 || index > MaxNodes {
		return nodePlan{}, fmt.Errorf("node index %d out of range 2..%d", index, MaxNodes)
	}
	return nodePlan{Name: name, Index: index}, nil
}

// freeIndex is the lowest node index in 2..MaxNodes not in used.
func freeIndex(used []int) (int, error) {
	taken := map[int]bool{}
	for _, i := range used {
		taken[i] = true
	}
	for i := 2; i <= MaxNodes; i++ {
		if !taken[i] {
			return i, nil
		}
	}
	return 0, fmt.Errorf("a test bed has at most %d nodes", MaxNodes)
}

func (p nodePlan) k() string { return strconv.Itoa(p.Index) }

// HostIP is the host side of the node's link, its default gateway.
func (p nodePlan) HostIP() string { return "10.216." + p.k() + ".1" }

// NodeIP is the node's InternalIP (its side of the link).
func (p nodePlan) NodeIP() string { return "10.216." + p.k() + ".2" }

// PodCIDR is the node's pod range; PodGateway its bridge address.
func (p nodePlan) PodCIDR() string    { return "10.215." + p.k() + ".0/24" }
func (p nodePlan) PodGateway() string { return "10.215." + p.k() + ".1" }

// HostVeth is the host side of the link; the node side is eth0.
func (p nodePlan) HostVeth() string { return nodeVethPrefix + p.k() }

// CgroupRoot is the kubelet's --cgroup-root.
func (p nodePlan) CgroupRoot() string { return "/" + nodeCgroupPrefix + p.Name }

// Dir is the node's state on the host; inside the node it is bound over the test
// bed's own paths (mounts()).
func (p nodePlan) Dir() string { return filepath.Join(nodesDir, p.Name) }

// NetnsFile and MntnsFile are the files the node's namespaces are bound to.
func (p nodePlan) NetnsFile() string { return filepath.Join(nodesRunDir, p.Name+".net") }
func (p nodePlan) MntnsFile() string { return filepath.Join(nodesRunDir, p.Name+".mnt") }

// binds are the node's directories bound over the test bed's paths inside its
// mount namespace: what hostPath volumes, containerd and the kubelet see there.
func (p nodePlan) binds() [][2]string {
	var out [][2]string
	for _, d := range []string{"cni", "kubelet", "containerd", "pod-logs"} {
		out = append(out, [2]string{filepath.Join(p.Dir(), d), filepath.Join(BaseDir, d)})
	}
	return out
}

// cniDirs are the node's CNI configuration and plugin directories on the host.
func (p nodePlan) cniConfDir() string { return filepath.Join(p.Dir(), "cni", "net.d") }
func (p nodePlan) cniBinDir() string  { return filepath.Join(p.Dir(), "cni", "bin") }

// defaultPlugins is DefaultPlugins for this node: the same chain on its own range.
func (p nodePlan) defaultPlugins() []map[string]any {
	return plugins(p.PodCIDR(), p.PodGateway())
}

// kubeletConfig is the node's KubeletConfiguration.
func (p nodePlan) kubeletConfig() string {
	return kubeletConfigFor(p.NodeIP(), filepath.Join(p.Dir(), "pki", "kubelet-serving.crt"),
		filepath.Join(p.Dir(), "pki", "kubelet-serving.key"), p.CgroupRoot())
}

// certs are the node's kubelet client and serving certificates.
func (p nodePlan) certs() []certSpec {
	return []certSpec{
		{file: "kubelet", cn: "system:node:" + p.Name, orgs: []string{"system:nodes"}, client: true},
		{file: "kubelet-serving", cn: p.Name, server: true, ips: []string{p.NodeIP(), "127.0.0.1"}, dns: []string{p.Name, "localhost"}},
	}
}
