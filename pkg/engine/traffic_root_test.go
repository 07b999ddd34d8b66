package engine_test

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/meshcni/meshcni/internal/standin/proxysim"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/internal/testkit/traffic"
	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/engine"
	"github.com/meshcni/meshcni/pkg/spec"
)

var appUser = traffic.Cred{UID: 1000, GID: 1000}

// backendsUnderTest are the backends proven with real packets.
func backendsUnderTest(t *testing.T) []backend.Kind {
	kinds := []backend.Kind{backend.IptablesLegacy, backend.IptablesNft}
	if _, err := engine.New(backend.Nftables); err == nil {
		kinds = append(kinds, backend.Nftables)
	} else if testutil.InCI() {
		t.Logf("native nftables backend unavailable: %v", err)
	}
	return kinds
}

// expectation of one connection.
type want int

const (
	toOutbound want = iota // the proxy's outbound listener, original destination intact
	toInbound              // the proxy's inbound listener, original destination intact
	toApp                  // the app itself (not captured)
	fails                  // nothing answers: the connection is dropped
)

type probe struct {
	name   string
	from   string // "pod" or "peer"
	cred   traffic.Cred
	dst    netip.AddrPort
	source netip.AddrPort
	want   want
}

var (
	peer4  = netip.AddrPortFrom(traffic.PeerIPv4, 8080)
	peer6  = netip.AddrPortFrom(traffic.PeerIPv6, 8080)
	pod4   = netip.AddrPortFrom(traffic.PodIPv4, 9090)
	pod6   = netip.AddrPortFrom(traffic.PodIPv6, 9090)
	pod4x  = netip.AddrPortFrom(traffic.PodIPv4, 15021) // excluded inbound by default
	peer4b = netip.AddrPortFrom(traffic.PeerIPv4, 8081)
)

// run dials p.dst from the pod or its peer and checks what answered.
func (p probe) run(t *testing.T, pod *traffic.Pod) {
	t.Helper()
	from := pod.NetNS
	if p.from == "peer" {
		from = pod.PeerNetNS
	}
	opts := traffic.DialOptions{Cred: p.cred, Source: p.source}
	if p.want == fails {
		opts.Timeout = time.Second // a dropped SYN: the client gives up after this
	}
	a := traffic.Dial(t, from, p.dst, opts)
	switch p.want {
	case toOutbound, toInbound:
		l := proxysim.ListenerOutbound
		if p.want == toInbound {
			l = proxysim.ListenerInbound
		}
		if a.Listener() != l || a.OrigDst() != p.dst {
			t.Errorf("%s: want %s listener with original destination %v, got listener %q orig %v (%+v)", p.name, l, p.dst, a.Listener(), a.OrigDst(), a.ProbeResult)
		}
	case toApp:
		if a.App == nil {
			t.Errorf("%s: want the app itself, got listener %q (%+v)", p.name, a.Listener(), a.ProbeResult)
		}
	case fails:
		if a.App != nil || a.Proxy != nil || a.Error == "" {
			t.Errorf("%s: want the connection to fail, got listener %q app %+v (%+v)", p.name, a.Listener(), a.App, a.ProbeResult)
		}
	}
}

// TestRedirectTraffic proves the engine's rules with real packets in real
// namespaces: a "pod" netns joined by veth to a peer, the stand-in proxy running
// as UID 1337 recording SO_ORIGINAL_DST, app servers, clients as UID 1000 or 1337.
func TestRedirectTraffic(t *testing.T) {
	testutil.RequireRoot(t)
	dual := func(mut func(*spec.Spec)) *spec.Spec {
		s := spec.PodDefaults()
		s.EnableIPv6 = true
		if mut != nil {
			mut(&s)
		}
		return &s
	}
	cases := []struct {
		name   string
		spec   *spec.Spec
		tproxy bool
		probes []probe
	}{
		{"pod defaults", dual(nil), false, []probe{
			{"outbound v4 captured", "pod", appUser, peer4, netip.AddrPort{}, toOutbound},
			{"outbound v6 captured", "pod", appUser, peer6, netip.AddrPort{}, toOutbound},
			{"proxy's own v4 exempt", "pod", traffic.ProxyCred, peer4, netip.AddrPort{}, toApp},
			{"proxy's own v6 exempt", "pod", traffic.ProxyCred, peer6, netip.AddrPort{}, toApp},
			{"inbound v4 captured", "peer", appUser, pod4, netip.AddrPort{}, toInbound},
			{"inbound v6 captured", "peer", appUser, pod6, netip.AddrPort{}, toInbound},
			{"inbound 15021 excluded", "peer", appUser, pod4x, netip.AddrPort{}, toApp},
			{"127.0.0.6 passthrough", "pod", traffic.ProxyCred, pod4, netip.MustParseAddrPort("127.0.0.6:0"), toApp},
		}},
		{"exclude outbound port and CIDR", dual(func(s *spec.Spec) {
			s.OutboundPortsExclude = []uint16{8081}
			s.OutboundIPRangesExclude = []netip.Prefix{netip.MustParsePrefix("fd00:250::1/128")}
		}), false, []probe{
			{"excluded port", "pod", appUser, peer4b, netip.AddrPort{}, toApp},
			{"other port captured", "pod", appUser, peer4, netip.AddrPort{}, toOutbound},
			{"excluded v6 CIDR", "pod", appUser, peer6, netip.AddrPort{}, toApp},
		}},
		{"include only some outbound CIDRs and inbound ports", dual(func(s *spec.Spec) {
			s.OutboundIPRanges = spec.PrefixSet{Prefixes: []netip.Prefix{netip.MustParsePrefix("10.250.0.0/24")}}
			s.InboundPorts = spec.PortSet{Ports: []uint16{9090}}
		}), false, []probe{
			{"included v4 CIDR", "pod", appUser, peer4, netip.AddrPort{}, toOutbound},
			{"v6 not included", "pod", appUser, peer6, netip.AddrPort{}, toApp},
			{"included inbound port", "peer", appUser, pod4, netip.AddrPort{}, toInbound},
			{"inbound port not included", "peer", appUser, netip.AddrPortFrom(traffic.PodIPv4, 9091), netip.AddrPort{}, toApp},
		}},
		{"exclude interface eth0", dual(func(s *spec.Spec) { s.ExcludeInterfaces = []string{"eth0"} }), false, []probe{
			{"outbound via eth0 bypasses", "pod", appUser, peer4, netip.AddrPort{}, toApp},
			{"inbound via eth0 bypasses", "peer", appUser, pod4, netip.AddrPort{}, toApp},
		}},
		{"tproxy", dual(func(s *spec.Spec) { s.Mode = spec.ModeTProxy }), true, []probe{
			{"inbound v4 by tproxy", "peer", appUser, pod4, netip.AddrPort{}, toInbound},
			{"inbound v6 by tproxy", "peer", appUser, pod6, netip.AddrPort{}, toInbound},
			{"outbound still redirected", "pod", appUser, peer4, netip.AddrPort{}, toOutbound},
		}},
	}
	for _, kind := range backendsUnderTest(t) {
		for _, tc := range cases {
			t.Run(string(kind)+"/"+tc.name, func(t *testing.T) {
				pod := traffic.NewPod(t)
				traffic.StartApp(t, pod.PeerNetNS, netip.MustParseAddrPort("[::]:8080"), "peer-app")
				traffic.StartApp(t, pod.PeerNetNS, netip.MustParseAddrPort("[::]:8081"), "peer-app")
				for _, p := range []string{"[::]:9090", "[::]:9091", "[::]:15021"} {
					traffic.StartApp(t, pod.NetNS, netip.MustParseAddrPort(p), "pod-app")
				}
				traffic.StartProxy(t, pod.NetNS, traffic.ProxyOptions{TPROXY: tc.tproxy})
				used, err := engine.Apply(context.Background(), engine.Options{Backend: kind, NetnsPath: pod.NetNS}, tc.spec)
				if err != nil {
					t.Fatalf("apply: %v", err)
				}
				if used != kind {
					t.Fatalf("applied with %s, want %s", used, kind)
				}
				for _, p := range tc.probes {
					p.run(t, pod)
				}
				d, err := engine.Check(context.Background(), engine.Options{Backend: kind, NetnsPath: pod.NetNS}, tc.spec)
				if err != nil || !d.Empty() {
					t.Fatalf("check after apply: %v, drift:\n%s", err, d)
				}
				if err := engine.Clean(context.Background(), engine.Options{NetnsPath: pod.NetNS}); err != nil {
					t.Fatalf("clean: %v", err)
				}
				if a := traffic.Dial(t, pod.NetNS, peer4, traffic.DialOptions{Cred: appUser}); a.App == nil {
					t.Fatalf("after clean the app must be reached directly, got %+v", a.ProbeResult)
				}
			})
		}
	}
}

// TestDNSCapture: with DNS capture, an app's query to a nameserver reaches the
// proxy's DNS port; the proxy's own query is not captured (no loop).
func TestDNSCapture(t *testing.T) {
	testutil.RequireRoot(t)
	for _, kind := range backendsUnderTest(t) {
		t.Run(string(kind), func(t *testing.T) {
			pod := traffic.NewPod(t)
			upstream := netip.AddrPortFrom(traffic.PeerIPv4, 53)
			traffic.StartProxy(t, pod.PeerNetNS, traffic.ProxyOptions{Cred: &traffic.Root, Args: []string{
				"--outbound-port=0", "--inbound-port=0", "--ipv6=false",
				"--dns-port=53", "--dns-listen-v4=0.0.0.0", "--dns-answer=10.8.8.8"}})
			traffic.StartProxy(t, pod.NetNS, traffic.ProxyOptions{Args: []string{"--dns-port=15053", "--dns-answer=10.9.9.9"}})
			s := spec.PodDefaults()
			s.RedirectDNS = true
			s.DNSServersV4 = []netip.Addr{traffic.PeerIPv4}
			if _, err := engine.Apply(context.Background(), engine.Options{Backend: kind, NetnsPath: pod.NetNS}, &s); err != nil {
				t.Fatalf("apply: %v", err)
			}
			for _, tcp := range []bool{false, true} {
				res := traffic.QueryDNS(t, pod.NetNS, upstream, "svc.example.", traffic.DNSOptions{Cred: appUser, TCP: tcp})
				if res.Error != "" || len(res.Answers) != 1 || res.Answers[0].String() != "10.9.9.9" {
					t.Errorf("app query (tcp=%v): want the proxy's answer 10.9.9.9, got %+v", tcp, res)
				}
			}
			res := traffic.QueryDNS(t, pod.NetNS, upstream, "svc.example.", traffic.DNSOptions{Cred: traffic.ProxyCred})
			if res.Error != "" || len(res.Answers) != 1 || res.Answers[0].String() != "10.8.8.8" {
				t.Errorf("proxy's own query: want the upstream's answer 10.8.8.8, got %+v", res)
			}
		})
	}
}
