package engine_test

import (
	"context"
	"net/netip"
	"testing"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/internal/testkit/traffic"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/engine"
	"github.com/meshcni/meshcni/pkg/spec"
)

// meshedPod is an Istio-injected pod as the plugin reads it; dualStack sets
// ISTIO_DUAL_STACK=true on its istio-proxy (Istio's proxyMetadata does), ipv6 the
// meshcni.io/ipv6 annotation ("" for none).
func meshedPod(dualStack bool, ipv6 string) *capture.Pod {
	p := &capture.Pod{}
	p.Namespace, p.Name = "app", "web"
	p.Annotations = map[string]string{capture.AnnotationStatus: "{}"}
	if ipv6 != "" {
		p.Annotations[capture.AnnotationIPv6] = ipv6
	}
	proxy := capture.Container{Name: capture.ProxyContainer, Args: []string{"proxy", "sidecar"}}
	if dualStack {
		proxy.Env = []capture.EnvVar{{Name: capture.EnvDualStack, Value: "true"}}
	}
	p.Spec.Containers = []capture.Container{{Name: "app"}, proxy}
	return p
}

// TestIPv6Modes proves each IPv6 mode with real packets in a dual-stack pod
// (10.250.0.2 and fd00:250::2), identically on every backend. The spec comes from
// the pod as the plugin derives it (capture: Istio's decision from ISTIO_DUAL_STACK
// and the pod's addresses, the mode from the annotation or the node's ipv6 key).
// The stand-in proxy runs as UID 1337 and listens on IPv4 and IPv6 (0.0.0.0 and
// [::]), so a captured IPv6 connection shows at its listener with its
// SO_ORIGINAL_DST, and one that passes reaches the app at the real destination.
func TestIPv6Modes(t *testing.T) {
	testutil.RequireRoot(t)
	var (
		lo6       = netip.MustParseAddrPort("[::1]:9090")
		outbound4 = probe{"IPv4 outbound captured", "pod", appUser, peer4, netip.AddrPort{}, toOutbound}
		inbound4  = probe{"IPv4 inbound captured", "peer", appUser, pod4, netip.AddrPort{}, toInbound}
		captured6 = []probe{
			outbound4, inbound4,
			{"IPv6 outbound captured", "pod", appUser, peer6, netip.AddrPort{}, toOutbound},
			{"IPv6 inbound captured", "peer", appUser, pod6, netip.AddrPort{}, toInbound},
			{"proxy's own IPv6 exempt", "pod", traffic.ProxyCred, peer6, netip.AddrPort{}, toApp},
			{"app to itself over [::1]", "pod", appUser, lo6, netip.AddrPort{}, toApp},
		}
		passed6 = []probe{
			outbound4, inbound4,
			{"IPv6 outbound passes", "pod", appUser, peer6, netip.AddrPort{}, toApp},
			{"IPv6 inbound passes", "peer", appUser, pod6, netip.AddrPort{}, toApp},
			{"proxy's own IPv6 passes", "pod", traffic.ProxyCred, peer6, netip.AddrPort{}, toApp},
			{"app to itself over [::1]", "pod", appUser, lo6, netip.AddrPort{}, toApp},
		}
		dropped6 = []probe{
			outbound4, inbound4,
			{"IPv6 outbound dropped", "pod", appUser, peer6, netip.AddrPort{}, fails},
			{"IPv6 inbound dropped", "peer", appUser, pod6, netip.AddrPort{}, fails},
			{"proxy's own IPv6 passes", "pod", traffic.ProxyCred, peer6, netip.AddrPort{}, toApp},
			{"app to itself over [::1]", "pod", appUser, lo6, netip.AddrPort{}, toApp},
		}
	)
	cases := []struct {
		name      string
		node      spec.IPv6Mode // the plugin's ipv6 key
		dualStack bool
		ann       string
		tproxy    bool
		probes    []probe
	}{
		{"istio, single-stack proxy", "", false, "", false, passed6},
		{"istio, ISTIO_DUAL_STACK", "", true, "", false, captured6},
		{"capture by annotation", "", false, "capture", false, captured6},
		{"capture by the plugin key", spec.IPv6Capture, false, "", false, captured6},
		{"drop by annotation", "", false, "drop", false, dropped6},
		{"drop by the plugin key", spec.IPv6Drop, false, "", false, dropped6},
		{"drop, ISTIO_DUAL_STACK captures", spec.IPv6Drop, true, "", false, captured6},
		{"annotation istio wins over the key drop", spec.IPv6Drop, false, "istio", false, passed6},
		{"istio, single-stack proxy, TPROXY", "", false, "", true, passed6},
		{"drop, TPROXY", "", false, "drop", true, dropped6},
	}
	for _, kind := range backendsUnderTest(t) {
		for _, tc := range cases {
			t.Run(string(kind)+"/"+tc.name, func(t *testing.T) {
				pod := traffic.NewPod(t)
				traffic.StartApp(t, pod.PeerNetNS, netip.MustParseAddrPort("[::]:8080"), "peer-app")
				traffic.StartApp(t, pod.NetNS, netip.MustParseAddrPort("[::]:9090"), "pod-app")
				traffic.StartProxy(t, pod.NetNS, traffic.ProxyOptions{TPROXY: tc.tproxy})
				mp := meshedPod(tc.dualStack, tc.ann)
				if tc.tproxy {
					mp.Annotations[capture.AnnotationInterceptionMode] = "TPROXY"
				}
				res, err := capture.Config{IPv6: tc.node}.ForPod(mp, []netip.Addr{pod.IPv4, pod.IPv6})
				if err != nil {
					t.Fatal(err)
				}
				opts := engine.Options{Backend: kind, NetnsPath: pod.NetNS}
				if _, err := engine.Apply(context.Background(), opts, res.Spec); err != nil {
					t.Fatalf("apply: %v", err)
				}
				for _, p := range tc.probes {
					p.run(t, pod)
				}
				if d, err := engine.Check(context.Background(), opts, res.Spec); err != nil || !d.Empty() {
					t.Fatalf("check after apply: %v, drift:\n%s", err, d)
				}
				if err := engine.Clean(context.Background(), engine.Options{NetnsPath: pod.NetNS}); err != nil {
					t.Fatalf("clean: %v", err)
				}
				for _, dst := range []netip.AddrPort{peer4, peer6} {
					if a := traffic.Dial(t, pod.NetNS, dst, traffic.DialOptions{Cred: appUser}); a.App == nil {
						t.Fatalf("after clean the app at %v must be reached directly, got %+v", dst, a.ProbeResult)
					}
				}
			})
		}
	}
}
