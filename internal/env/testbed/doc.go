// Package testbed brings up a real Kubernetes on this machine for tests and the
// demo, with one node or a few: etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
// kubelet and a test-bed-owned containerd, with no kube-proxy and no registry.
//
// Everything lives in test-bed-owned places (see the constants in layout.go): state
// under /var/lib/meshcni-testbed and a tmpfs at /run/meshcni-testbed, logs under
// /var/log/meshcni-testbed, the CNI configuration and plugins in CNIConfDir and
// CNIBinDir (never the host's /etc/cni/net.d), and the pod bridge mcni0 carrying
// the node IP. Tests may rewrite the CNI configuration freely; containerd reads the
// first file of CNIConfDir at every sandbox creation.
//
// Binaries (Kubernetes built from k8s.io/kubernetes, the reference CNI plugins, the
// pause and echo images) are built once by `hack/testbed build` (or Build) and
// cached; Lookup finds them. Start brings a node up in seconds from the cache.
//
// Only one test bed can run on a machine. Start holds an exclusive file lock
// (LockFile) until Stop, so test binaries of several packages that use the test bed
// serialise on it even under a parallel `go test ./...`; Shared starts one per test
// binary (or attaches to one started by `hack/testbed up`).
//
// Extra nodes (Options.Nodes, AddNode, Node.Remove, Node.Kill) each run their own
// containerd and kubelet in their own network and mount namespaces, with their own
// node IP, pod range, CNI directories, kubelet root and cgroup root (node.go,
// nodens.go, nodeplan.go); pods reach each other across nodes by pod IP.
//
// There is no kube-proxy: pods reach the API server only with hostNetwork and
// KUBERNETES_SERVICE_HOST=127.0.0.1, KUBERNETES_SERVICE_PORT=6443 (see
// APIServerEnv), or, once an extra node has joined, from every node and pod at
// ClusterAPIServerHost (ClusterAPIServerEnv).
package testbed
