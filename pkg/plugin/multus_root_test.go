package plugin_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/netip"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"
	corev1 "k8s.io/api/core/v1"

	"github.com/meshcni/meshcni/internal/standin/proxysim"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/internal/testkit/traffic"
	"github.com/meshcni/meshcni/pkg/agent"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/install"
)

// staticPods is an agent pod source holding fixed pods (the agent's informer
// cache, without an API server).
type staticPods map[string]*corev1.Pod

func (s staticPods) HasSynced() bool { return true }
func (s staticPods) Get(ns, name string) (*corev1.Pod, bool) {
	p, ok := s[ns+"/"+name]
	return p, ok
}

// TestMultusStandaloneList runs meshcni the way Multus runs an additional network:
// the list the agent writes with --chained=false --network-name istio-cni (what the
// chart's provider multus sets), ADD through libcni with no prevResult, in a pod
// netns whose interface the default network already set up. The pod is answered
// by the real agent socket (no API server). The redirect is then in place for both
// families (real packets to a UID 1337 proxy reading SO_ORIGINAL_DST), CHECK
// passes, DEL removes it; a netns with no address fails the ADD closed.
func TestMultusStandaloneList(t *testing.T) {
	testutil.RequireRoot(t)
	bin := binaries(t)
	pod := traffic.NewPod(t)
	k8sPod := injectedPod(e2eNamespace, "multus", withProxyEnv(capture.EnvDualStack, "true"))
	k8sPod.UID = "uid-multus"
	runDir := startAgentSocket(t, staticPods{k8sPod.Namespace + "/" + k8sPod.Name: k8sPod})
	list := standaloneList(t, bin, runDir)
	cni := libcni.NewCNIConfigWithCacheDir([]string{bin}, t.TempDir(), nil)
	ctx := context.Background()

	t.Run("no address fails closed", func(t *testing.T) {
		empty := testutil.NewNetns(t) // lo only: the default network did not run
		_, err := cni.AddNetworkList(ctx, list, runtimeConf(empty, k8sPod))
		var e *types.Error
		if !errors.As(err, &e) || e.Code != types.ErrInvalidNetworkConfig || !strings.Contains(e.Msg, "holds no address") {
			t.Fatalf("ADD in a netns with no address: %v", err)
		}
		if rules := live(t, empty); len(rules) != 0 {
			t.Fatalf("rules written despite the failure: %v", rules)
		}
	})

	proxy := traffic.StartProxy(t, pod.NetNS, traffic.ProxyOptions{})
	rt := runtimeConf(pod.NetNS, k8sPod)
	res, err := cni.AddNetworkList(ctx, list, rt)
	if err != nil {
		t.Fatalf("ADD: %v", err)
	}
	out, err := json.Marshal(res)
	if err != nil {
		t.Fatal(err)
	}
	var r map[string]any
	if err := json.Unmarshal(out, &r); err != nil || r["cniVersion"] != "1.0.0" || r["ips"] != nil || r["interfaces"] != nil {
		t.Fatalf("ADD result %s, want an empty 1.0.0 result", out)
	}
	app := traffic.Cred{UID: 1000, GID: 1000}
	for _, f := range []struct {
		name      string
		pod, peer netip.Addr
	}{{"ipv4", pod.IPv4, pod.PeerIPv4}, {"ipv6", pod.IPv6, pod.PeerIPv6}} {
		t.Run(f.name+" outbound", func(t *testing.T) {
			dst := netip.AddrPortFrom(f.peer, 8080)
			a := traffic.Dial(t, pod.NetNS, dst, traffic.DialOptions{Cred: app})
			if a.Listener() != proxysim.ListenerOutbound || a.OrigDst() != dst || a.Proxy.UID != traffic.ProxyUID {
				t.Fatalf("want the outbound listener (uid %d) with original destination %v, got %+v (proxy %+v)", traffic.ProxyUID, dst, a.ProbeResult, a.Proxy)
			}
		})
		t.Run(f.name+" inbound", func(t *testing.T) {
			dst := netip.AddrPortFrom(f.pod, 9090)
			a := traffic.Dial(t, pod.PeerNetNS, dst, traffic.DialOptions{Cred: app})
			if a.Listener() != proxysim.ListenerInbound || a.OrigDst() != dst {
				t.Fatalf("want the inbound listener with original destination %v, got %+v (proxy %+v)", dst, a.ProbeResult, a.Proxy)
			}
		})
	}
	if len(proxy.Records()) == 0 {
		t.Fatal("the proxy recorded nothing")
	}
	if err := cni.CheckNetworkList(ctx, list, rt); err != nil {
		t.Fatalf("CHECK: %v", err)
	}
	if err := cni.DelNetworkList(ctx, list, rt); err != nil {
		t.Fatalf("DEL: %v", err)
	}
	if rules := live(t, pod.NetNS); len(rules) != 0 {
		t.Fatalf("rules left after DEL: %v", rules)
	}
}

// standaloneList writes the list as the agent does for Multus (its flags, its
// install.Install) into a fresh configuration directory and loads it as Multus does.
func standaloneList(t *testing.T, binDir, runDir string) *libcni.NetworkConfigList {
	t.Helper()
	confDir := t.TempDir()
	cfg, err := agent.ParseFlags([]string{"--chained=false", "--network-name=istio-cni", "--cni-conf-dir=" + confDir,
		"--cni-bin-dir=" + binDir, "--run-dir=" + runDir, "--plugin-log-level=debug"}, func(string) string { return "" }, nil)
	if err != nil {
		t.Fatalf("agent flags: %v", err)
	}
	res, err := install.InstallConflist(install.ConflistOptions{Dir: cfg.CNIConfDir, Chained: cfg.Chained, StandaloneFile: cfg.StandaloneFileName,
		NetworkName: cfg.NetworkName, Entry: cfg.Entry()})
	if err != nil {
		t.Fatalf("install the standalone list: %v", err)
	}
	if filepath.Dir(res.Path) != confDir {
		t.Fatalf("list written to %s, not in %s", res.Path, confDir)
	}
	list, err := libcni.ConfListFromFile(res.Path)
	if err != nil {
		t.Fatal(err)
	}
	if list.Name != "istio-cni" || len(list.Plugins) != 1 || list.Plugins[0].Network.Type != "meshcni" {
		t.Fatalf("list %s: name %q, %d plugins", res.Path, list.Name, len(list.Plugins))
	}
	return list
}
