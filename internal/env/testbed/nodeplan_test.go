package testbed

import (
	"net"
	"slices"
	"strings"
	"testing"
)

func TestNodePlan(t *testing.T) {
	for _, tc := range []struct {
		name    string
		index   int
		wantErr string
		nodeIP  string
		hostIP  string
		pods    string
		veth    string
		cgroup  string
	}{
		{name: "b", index: 2, nodeIP: "10.216.2.2", hostIP: "10.216.2.1", pods: "10.215.2.0/24", veth: "mcnv2", cgroup: "/meshcni-node-b"},
		{name: "meshcni-testbed-3", index: 3, nodeIP: "10.216.3.2", hostIP: "10.216.3.1", pods: "10.215.3.0/24", veth: "mcnv3", cgroup: "/meshcni-node-meshcni-testbed-3"},
		{name: "Upper", index: 2, wantErr: "DNS label"},
		{name: "a_b", index: 2, wantErr: "DNS label"},
		{name: "-a", index: 2, wantErr: "DNS label"},
		{name: strings.Repeat("a", 41), index: 2, wantErr: "DNS label"},
		{name: NodeName, index: 2, wantErr: "node 1's"},
		{name: "b", index: 1, wantErr: "out of range"},
		{name: "b", index: MaxNodes + 1, wantErr: "out of range"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := newNodePlan(tc.name, tc.index)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			got := []string{p.NodeIP(), p.HostIP(), p.PodCIDR(), p.HostVeth(), p.CgroupRoot()}
			want := []string{tc.nodeIP, tc.hostIP, tc.pods, tc.veth, tc.cgroup}
			if !slices.Equal(got, want) {
				t.Fatalf("plan = %v, want %v", got, want)
			}
			if len(p.HostVeth()) > 15 {
				t.Errorf("veth name %q longer than IFNAMSIZ-1", p.HostVeth())
			}
			// Every node's ranges are disjoint from node 1's and the services'.
			for _, r := range []string{PodCIDR, ServiceCIDR} {
				_, n, _ := net.ParseCIDR(r)
				for _, c := range []string{p.PodCIDR(), p.NodeIP() + "/24"} {
					ip, _, _ := net.ParseCIDR(c)
					if n.Contains(ip) {
						t.Errorf("%s overlaps %s", c, r)
					}
				}
			}
		})
	}
}

func TestFreeIndex(t *testing.T) {
	for _, tc := range []struct {
		used []int
		want int
	}{{nil, 2}, {[]int{2}, 3}, {[]int{3, 2}, 4}, {[]int{3}, 2}} {
		if got, err := freeIndex(tc.used); err != nil || got != tc.want {
			t.Errorf("freeIndex(%v) = %d, %v; want %d", tc.used, got, err, tc.want)
		}
	}
	var all []int
	for i := 2; i <= MaxNodes; i++ {
		all = append(all, i)
	}
	if _, err := freeIndex(all); err == nil {
		t.Error("freeIndex of a full test bed succeeded")
	}
}

func TestTopmost(t *testing.T) {
	got := topmost([]string{"/run/x/a/b", "/run/x", "/var/k/p/v", "/var/k/p/v/w", "/run/xy"})
	want := []string{"/run/x", "/run/xy", "/var/k/p/v"}
	if !slices.Equal(got, want) {
		t.Fatalf("topmost = %v, want %v", got, want)
	}
}

// TestNodeConfig: a node's kubelet serves on its own IP with its own cgroup root
// and certificates; its CNI chain uses its own range; node 1's configuration
// has no cgroup root.
func TestNodeConfig(t *testing.T) {
	p, err := newNodePlan("b", 2)
	if err != nil {
		t.Fatal(err)
	}
	kc := p.kubeletConfig()
	for _, want := range []string{`address: "10.216.2.2"`, `cgroupRoot: "/meshcni-node-b"`, BaseDir + "/nodes/b/pki/kubelet-serving.crt"} {
		if !strings.Contains(kc, want) {
			t.Errorf("kubelet config lacks %s:\n%s", want, kc)
		}
	}
	if one := kubeletConfig(); strings.Contains(one, "cgroupRoot") || !strings.Contains(one, `address: "`+NodeIP+`"`) {
		t.Errorf("node 1's kubelet config:\n%s", one)
	}
	conf, err := Conflist(p.defaultPlugins())
	if err != nil {
		t.Fatal(err)
	}
	if s := string(conf); !strings.Contains(s, `"subnet": "10.215.2.0/24"`) || !strings.Contains(s, `"gateway": "10.215.2.1"`) || strings.Contains(s, PodCIDR) {
		t.Errorf("node conflist:\n%s", s)
	}
	binds := p.binds()
	if len(binds) != 4 || binds[0] != [2]string{BaseDir + "/nodes/b/cni", BaseDir + "/cni"} {
		t.Errorf("binds = %v", binds)
	}
}
