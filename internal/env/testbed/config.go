package testbed

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
)

func containerdConfig() string {
	return fmt.Sprintf(`version = 2
root = %q
state = %q
oom_score = 0

[grpc]
  address = %q

[ttrpc]
  address = ""

[debug]
  address = ""

[metrics]
  address = ""

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = %q
    # This VM lacks CAP_SYS_RESOURCE: without this every sandbox fails with
    # "can't get final child's PID from pipe".
    restrict_oom_score_adj = true
    netns_mounts_under_state_dir = true
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
    enable_selinux = false
    tolerate_missing_hugetlb_controller = true
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = %q
      conf_dir = %q
      max_conf_num = 1
    [plugins."io.containerd.grpc.v1.cri".containerd]
      snapshotter = "overlayfs"
      default_runtime_name = "runc"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          SystemdCgroup = false
`, containerdRoot, containerdState, containerdSocket, PauseImage, CNIBinDir, CNIConfDir)
}

func kubeletConfig() string {
	return kubeletConfigFor(NodeIP, pkiPath("kubelet-serving.crt"), pkiPath("kubelet-serving.key"), "")
}

// kubeletConfigFor renders a KubeletConfiguration for a node at nodeIP serving
// with cert and key; cgroupRoot, when set, is the node's own cgroup tree.
func kubeletConfigFor(nodeIP, cert, key, cgroupRoot string) string {
	extra := ""
	if cgroupRoot != "" {
		extra = fmt.Sprintf("cgroupRoot: %q\n", cgroupRoot)
	}
	return fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: %q
port: %d
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: %d
containerRuntimeEndpoint: unix://%s
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
podLogsDir: %q
tlsCertFile: %q
tlsPrivateKeyFile: %q
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: true
  x509:
    clientCAFile: %q
authorization:
  mode: Webhook
clusterDomain: cluster.local
resolvConf: /etc/resolv.conf
# Imported images must never be garbage-collected: there is no registry.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: "1Mi"
  nodefs.available: "1%%"
  nodefs.inodesFree: "1%%"
  imagefs.available: "1%%"
evictionPressureTransitionPeriod: 5s
nodeStatusUpdateFrequency: 4s
syncFrequency: 10s
fileCheckFrequency: 20s
serializeImagePulls: false
maxPods: 110
protectKernelDefaults: false
%s`, nodeIP, KubeletPort, KubeletHealthzPort, containerdSocket, podLogsDir,
		cert, key, pkiPath("ca.crt"), extra)
}

// DefaultPlugins returns the reference plugin chain of the default CNI
// configuration: bridge (on BridgeName, gateway NodeIP) with host-local IPAM over
// PodCIDR, then portmap. Callers append their own plugin (e.g. meshcni) and pass the
// result to Conflist.
func DefaultPlugins() []map[string]any { return plugins(PodCIDR, NodeIP) }

// plugins is the reference chain on the pod range cidr with gateway gw.
func plugins(cidr, gw string) []map[string]any {
	return []map[string]any{
		{
			"type":             "bridge",
			"bridge":           BridgeName,
			"isGateway":        true,
			"ipMasq":           false,
			"hairpinMode":      true,
			"promiscMode":      false,
			"forceAddress":     false,
			"isDefaultGateway": true,
			"ipam": map[string]any{
				"type":    "host-local",
				"ranges":  [][]map[string]string{{{"subnet": cidr, "gateway": gw}}},
				"dataDir": filepath.Join(BaseDir, "cni", "ipam"),
			},
		},
		{"type": "portmap", "capabilities": map[string]bool{"portMappings": true}, "snat": true},
	}
}

// Conflist renders a CNI configuration list (cniVersion 1.0.0, name NetworkName)
// from plugin entries.
func Conflist(plugins []map[string]any) ([]byte, error) {
	b, err := json.MarshalIndent(map[string]any{
		"cniVersion": "1.0.0",
		"name":       NetworkName,
		"plugins":    plugins,
	}, "", "  ")
	if err != nil {
		return nil, fmt.Errorf("render conflist: %w", err)
	}
	return append(b, '\n'), nil
}

// DefaultConflist is Conflist(DefaultPlugins()).
func DefaultConflist() []byte {
	b, err := Conflist(DefaultPlugins())
	if err != nil {
		panic(err) // static data
	}
	return b
}

// WriteConflist replaces the test bed's CNI configuration: it removes every file
// of CNIConfDir and writes data as DefaultConflistName (atomically). New pod
// sandboxes use it at once; running pods keep their network.
func WriteConflist(data []byte) error { return writeConflistIn(CNIConfDir, data) }

func writeConflistIn(dir string, data []byte) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range ents {
		if e.Name() != DefaultConflistName {
			if err := os.RemoveAll(filepath.Join(dir, e.Name())); err != nil {
				return err
			}
		}
	}
	tmp := filepath.Join(dir, "."+DefaultConflistName+".tmp")
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return err
	}
	if err := os.Rename(tmp, filepath.Join(dir, DefaultConflistName)); err != nil {
		return fmt.Errorf("write conflist: %w", err)
	}
	return nil
}

// InstallCNIPlugin copies a plugin binary into CNIBinDir under name (atomically,
// so a running containerd never sees a partial file).
func InstallCNIPlugin(src, name string) error { return installPluginIn(CNIBinDir, src, name) }

func installPluginIn(dir, src, name string) error {
	data, err := os.ReadFile(src)
	if err != nil {
		return fmt.Errorf("install CNI plugin %s: %w", name, err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	tmp := filepath.Join(dir, "."+name+".tmp")
	if err := os.WriteFile(tmp, data, 0o755); err != nil {
		return fmt.Errorf("install CNI plugin %s: %w", name, err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, name)); err != nil {
		return fmt.Errorf("install CNI plugin %s: %w", name, err)
	}
	return nil
}
