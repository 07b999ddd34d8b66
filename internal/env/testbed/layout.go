package testbed

import (
	"path/filepath"
	"strconv"

	corev1 "k8s.io/api/core/v1"
)

// Fixed places and addresses of the test bed. Ports are on 127.0.0.1 (the kubelet's
// on NodeIP) and clash neither with each other nor with meshcni's 150xx ports.
const (
	// BaseDir holds persistent state: PKI, kubeconfigs, the CNI dirs, the kubelet
	// root and containerd's root. Removed by Stop/Down.
	BaseDir = "/var/lib/meshcni-testbed"
	// RunDir is a tmpfs holding etcd's data, containerd's state and socket, and the
	// state file of a running test bed. Unmounted and removed by Stop/Down.
	RunDir = "/run/meshcni-testbed"
	// LogDir holds one log per component; it survives Stop/Down for diagnosis and is
	// truncated by the next Start.
	LogDir = "/var/log/meshcni-testbed"
	// LockFile serialises test beds: Start holds an exclusive flock on it until Stop.
	LockFile = "/run/meshcni-testbed.lock"

	// CNIConfDir and CNIBinDir are the CNI configuration and plugin directories the
	// test bed's containerd uses.
	CNIConfDir = BaseDir + "/cni/net.d"
	CNIBinDir  = BaseDir + "/cni/bin"
	// DefaultConflistName is the file Start writes the CNI configuration to.
	DefaultConflistName = "10-testbed.conflist"
	// NetworkName is the CNI network name of the default configuration.
	NetworkName = "testbed"

	// BridgeName is the pod bridge, created by Start with NodeIP/16 on it.
	BridgeName = "mcni0"
	// PodCIDR is the pod range (host-local IPAM); NodeIP is its gateway and the
	// node's InternalIP.
	PodCIDR = "10.213.0.0/16"
	NodeIP  = "10.213.0.1"
	// ServiceCIDR is the service range (no kube-proxy: ClusterIPs do not route).
	ServiceCIDR = "10.214.0.0/16"
	// NodeName is the name of the single node.
	NodeName = "meshcni-testbed"

	APIServerHost = "127.0.0.1"
	APIServerPort = 6443
	EtcdPort      = 23790
	EtcdPeerPort  = 23800
	// KubeletPort listens on NodeIP; KubeletHealthzPort on 127.0.0.1.
	KubeletPort           = 10250
	KubeletHealthzPort    = 10248
	ControllerManagerPort = 10257
	SchedulerPort         = 10259

	// PauseImage is the sandbox image containerd is configured with; Start imports
	// a locally built one.
	PauseImage = "registry.k8s.io/pause:3.10"
	// EchoImage is a small test server imported by Start: it serves TCP on
	// EchoPort (replying "<hostname> <remote addr>\n" to every connection, and
	// echoing the first line sent) and has subcommands for exec: `/echo hostname`,
	// `/echo cat FILE`, `/echo env`.
	EchoImage = "meshcni.local/testbed/echo:dev"
	EchoPort  = 8080
)

// NetnsDir is where the test bed's containerd bind-mounts pod network namespaces
// (give it to podnetns.Finder, the agent's --repair-netns-dirs, meshcnictl inspect's
// --netns-dir).
var NetnsDir = filepath.Join(RunDir, "containerd/io.containerd.grpc.v1.cri/netns")

// Paths of generated files.
var (
	pkiDir               = filepath.Join(BaseDir, "pki")
	adminKubeconfig      = filepath.Join(BaseDir, "admin.kubeconfig")
	kubeletDir           = filepath.Join(BaseDir, "kubelet")
	containerdRoot       = filepath.Join(BaseDir, "containerd")
	containerdState      = filepath.Join(RunDir, "containerd")
	containerdSocket     = filepath.Join(RunDir, "containerd.sock")
	containerdConfigPath = filepath.Join(BaseDir, "containerd.toml")
	etcdDataDir          = filepath.Join(RunDir, "etcd")
	stateFile            = filepath.Join(RunDir, "state.json")
	podLogsDir           = filepath.Join(BaseDir, "pod-logs")
)

// KubeconfigPath is the admin kubeconfig of a running test bed.
func KubeconfigPath() string { return adminKubeconfig }

// ContainerdSocket is the test bed's containerd socket (for `ctr --address`).
func ContainerdSocket() string { return containerdSocket }

// APIServerEnv is the environment a hostNetwork pod needs to reach the API server
// through in-cluster configuration (there is no kube-proxy for the ClusterIP).
func APIServerEnv() []corev1.EnvVar {
	return []corev1.EnvVar{
		{Name: "KUBERNETES_SERVICE_HOST", Value: APIServerHost},
		{Name: "KUBERNETES_SERVICE_PORT", Value: strconv.Itoa(APIServerPort)},
	}
}

// ClusterAPIServerEnv is APIServerEnv for a test bed with several nodes: the API
// server at ClusterAPIServerHost, which every node and pod (hostNetwork or not)
// reaches once an extra node has joined.
func ClusterAPIServerEnv() []corev1.EnvVar {
	return []corev1.EnvVar{
		{Name: "KUBERNETES_SERVICE_HOST", Value: ClusterAPIServerHost},
		{Name: "KUBERNETES_SERVICE_PORT", Value: strconv.Itoa(APIServerPort)},
	}
}
