package traffic_test

import (
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/meshcni/meshcni/internal/standin/proxysim"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/internal/testkit/traffic"
)

var appUser = traffic.Cred{UID: 1000, GID: 1000}

type family struct {
	name     string
	v6       bool
	pod      netip.Addr
	peer     netip.Addr
	loopback netip.Addr
}

var families = []family{
	{"ipv4", false, traffic.PodIPv4, traffic.PeerIPv4, netip.MustParseAddr("127.0.0.1")},
	{"ipv6", true, traffic.PodIPv6, traffic.PeerIPv6, netip.IPv6Loopback()},
}

func TestPodWiring(t *testing.T) {
	testutil.RequireRoot(t)
	pod := traffic.NewPod(t, traffic.WithExtraInterface("eth1",
		netip.MustParsePrefix("10.251.0.2/24"), netip.MustParsePrefix("10.251.0.1/24"),
		netip.MustParsePrefix("fd00:251::2/64"), netip.MustParsePrefix("fd00:251::1/64")))
	if len(pod.Links) != 2 || pod.Links[1].Name != "eth1" {
		t.Fatalf("links = %+v", pod.Links)
	}
	traffic.StartApp(t, pod.PeerNetNS, netip.MustParseAddrPort("[::]:8080"), "peer-app")
	traffic.StartApp(t, pod.Links[1].PeerNetNS, netip.MustParseAddrPort("[::]:8080"), "eth1-app")
	traffic.StartApp(t, pod.NetNS, netip.MustParseAddrPort("[::]:9090"), "pod-app")

	tests := []struct {
		name     string
		from     string
		dst      string
		wantApp  string
		wantPeer netip.Addr
	}{
		{"pod to peer v4", pod.NetNS, "10.250.0.1:8080", "peer-app", traffic.PodIPv4},
		{"pod to peer v6", pod.NetNS, "[fd00:250::1]:8080", "peer-app", traffic.PodIPv6},
		{"pod to eth1 peer v4", pod.NetNS, "10.251.0.1:8080", "eth1-app", netip.MustParseAddr("10.251.0.2")},
		{"pod to eth1 peer v6", pod.NetNS, "[fd00:251::1]:8080", "eth1-app", netip.MustParseAddr("fd00:251::2")},
		{"peer to pod v4", pod.PeerNetNS, "10.250.0.2:9090", "pod-app", traffic.PeerIPv4},
		{"peer to pod v6", pod.PeerNetNS, "[fd00:250::2]:9090", "pod-app", traffic.PeerIPv6},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			a := traffic.Dial(t, tc.from, netip.MustParseAddrPort(tc.dst), traffic.DialOptions{Cred: appUser})
			if a.App == nil {
				t.Fatalf("no app answered: %+v", a.ProbeResult)
			}
			if a.App.Server != tc.wantApp || a.App.Peer.Addr() != tc.wantPeer {
				t.Fatalf("answer %+v, want server %s seeing peer %v", *a.App, tc.wantApp, tc.wantPeer)
			}
			if a.UID != 1000 {
				t.Fatalf("client ran as uid %d, want 1000", a.UID)
			}
		})
	}
}

// outboundRedirect writes the test's own minimal rules: the proxy UID is exempt, other
// TCP to the peer goes to 15001.
func outboundRedirect(t *testing.T, nsPath string, f family) {
	traffic.Iptables(t, nsPath, f.v6, "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "-m", "owner", "--uid-owner", "1337", "-j", "RETURN")
	traffic.Iptables(t, nsPath, f.v6, "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "-d", f.peer.String(), "-j", "REDIRECT", "--to-ports", "15001")
}

func TestOutboundRedirectRecord(t *testing.T) {
	testutil.RequireRoot(t)
	for _, f := range families {
		t.Run(f.name, func(t *testing.T) {
			pod := traffic.NewPod(t)
			traffic.StartApp(t, pod.PeerNetNS, netip.MustParseAddrPort("[::]:8080"), "peer-app")
			proxy := traffic.StartProxy(t, pod.NetNS, traffic.ProxyOptions{})
			outboundRedirect(t, pod.NetNS, f)
			dst := netip.AddrPortFrom(f.peer, 8080)

			// An application UID lands on the proxy, original destination intact.
			a := traffic.Dial(t, pod.NetNS, dst, traffic.DialOptions{Cred: appUser})
			if a.Listener() != proxysim.ListenerOutbound || a.OrigDst() != dst {
				t.Fatalf("uid 1000: want outbound listener with orig dst %v, got %+v (proxy %+v)", dst, a.ProbeResult, a.Proxy)
			}
			if a.Proxy.UID != traffic.ProxyUID || a.Proxy.Peer.Addr() != f.pod {
				t.Fatalf("proxy record %+v: want uid 1337 and peer %v", *a.Proxy, f.pod)
			}
			proxy.WaitRecord(t, 2*time.Second, func(r proxysim.Record) bool {
				return r.Event == proxysim.EventConn && r.OrigDst == dst
			})

			// The proxy UID is exempt: it reaches the app itself.
			a = traffic.Dial(t, pod.NetNS, dst, traffic.DialOptions{Cred: traffic.ProxyCred})
			if a.App == nil || a.App.Server != "peer-app" {
				t.Fatalf("uid 1337: want the peer app, got %+v", a.ProbeResult)
			}
		})
	}
}

func TestOutboundForward(t *testing.T) {
	testutil.RequireRoot(t)
	for _, f := range families {
		t.Run(f.name, func(t *testing.T) {
			pod := traffic.NewPod(t)
			traffic.StartApp(t, pod.PeerNetNS, netip.MustParseAddrPort("[::]:8080"), "peer-app")
			proxy := traffic.StartProxy(t, pod.NetNS, traffic.ProxyOptions{Args: []string{"--mode=forward"}})
			outboundRedirect(t, pod.NetNS, f)
			dst := netip.AddrPortFrom(f.peer, 8080)

			a := traffic.Dial(t, pod.NetNS, dst, traffic.DialOptions{Cred: appUser, Send: "hello"})
			if a.App == nil || a.App.Server != "peer-app" {
				t.Fatalf("want the peer app through the proxy, got %+v", a.ProbeResult)
			}
			r := proxy.WaitRecord(t, 2*time.Second, func(r proxysim.Record) bool {
				return r.Event == proxysim.EventConn && r.OrigDst == dst
			})
			if r.ForwardErr != "" || r.Forward != dst || r.UID != traffic.ProxyUID {
				t.Fatalf("proxy record %+v: want a forward to %v as uid 1337", r, dst)
			}
			// The app saw the proxy's own connection (not re-captured: it got through).
			if a.App.Peer != r.ForwardSource {
				t.Fatalf("app saw peer %v, proxy dialed from %v", a.App.Peer, r.ForwardSource)
			}
		})
	}
}

// Inbound: the peer's connection to the pod is redirected to 15006; the proxy forwards
// to the local app from 127.0.0.6 (Istio's inbound passthrough source).
func TestInboundForwardFromInboundSource(t *testing.T) {
	testutil.RequireRoot(t)
	pod := traffic.NewPod(t)
	f := families[0]
	traffic.StartApp(t, pod.NetNS, netip.MustParseAddrPort("0.0.0.0:9090"), "pod-app")
	proxy := traffic.StartProxy(t, pod.NetNS, traffic.ProxyOptions{Args: []string{"--mode=forward", "--inbound-source=127.0.0.6"}})
	traffic.Iptables(t, pod.NetNS, false, "-t", "nat", "-A", "PREROUTING", "-i", "eth0", "-p", "tcp", "-j", "REDIRECT", "--to-ports", "15006")
	dst := netip.AddrPortFrom(f.pod, 9090)

	a := traffic.Dial(t, pod.PeerNetNS, dst, traffic.DialOptions{Cred: appUser})
	if a.App == nil || a.App.Server != "pod-app" {
		t.Fatalf("want the pod app through the proxy, got %+v", a.ProbeResult)
	}
	if a.App.Peer.Addr() != netip.MustParseAddr("127.0.0.6") {
		t.Fatalf("app saw peer %v, want 127.0.0.6", a.App.Peer)
	}
	r := proxy.WaitRecord(t, 2*time.Second, func(r proxysim.Record) bool {
		return r.Listener == proxysim.ListenerInbound && r.OrigDst == dst
	})
	if r.Peer.Addr() != f.peer {
		t.Fatalf("inbound record peer %v, want %v", r.Peer, f.peer)
	}
}

// DNS capture: an app's query to any nameserver:53 lands on the proxy's 15053; the
// proxy's own upstream query (as 1337) is not captured, so forwarding does not loop.
func TestDNSCapture(t *testing.T) {
	testutil.RequireRoot(t)
	pod := traffic.NewPod(t)
	upstream := netip.AddrPortFrom(traffic.PeerIPv4, 53)
	// The "real" nameserver in the peer namespace: another proxysim, DNS only, as root.
	traffic.StartProxy(t, pod.PeerNetNS, traffic.ProxyOptions{Cred: &traffic.Root, Args: []string{
		"--outbound-port=0", "--inbound-port=0", "--ipv6=false",
		"--dns-port=53", "--dns-listen-v4=0.0.0.0", "--dns-answer=10.8.8.8"}})
	for _, proto := range []string{"udp", "tcp"} {
		traffic.Iptables(t, pod.NetNS, false, "-t", "nat", "-A", "OUTPUT", "-p", proto, "--dport", "53",
			"-m", "owner", "!", "--uid-owner", "1337", "-j", "REDIRECT", "--to-ports", "15053")
	}

	tests := []struct {
		name      string
		proxyArgs []string
		cred      traffic.Cred
		tcp       bool
		want      string
		captured  bool
	}{
		{"fixed answer udp", []string{"--dns-answer=10.9.9.9"}, appUser, false, "10.9.9.9", true},
		{"fixed answer tcp", []string{"--dns-answer=10.9.9.9"}, appUser, true, "10.9.9.9", true},
		{"upstream udp", []string{"--dns-upstream=" + upstream.String()}, appUser, false, "10.8.8.8", true},
		{"upstream tcp", []string{"--dns-upstream=" + upstream.String()}, appUser, true, "10.8.8.8", true},
		{"proxy uid not captured", []string{"--dns-answer=10.9.9.9"}, traffic.ProxyCred, false, "10.8.8.8", false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			args := append([]string{"--outbound-port=0", "--inbound-port=0", "--dns-port=15053"}, tc.proxyArgs...)
			proxy := traffic.StartProxy(t, pod.NetNS, traffic.ProxyOptions{Args: args})
			name := "svc-" + strings.ReplaceAll(tc.name, " ", "-") + ".example."
			res := traffic.QueryDNS(t, pod.NetNS, upstream, name, traffic.DNSOptions{Cred: tc.cred, TCP: tc.tcp})
			if res.Error != "" || len(res.Answers) != 1 || res.Answers[0].String() != tc.want {
				t.Fatalf("answer %+v, want %s", res, tc.want)
			}
			_, err := proxy.Wait(500*time.Millisecond, func(r proxysim.Record) bool { return r.Query == name })
			if captured := err == nil; captured != tc.captured {
				t.Fatalf("query captured = %v, want %v", captured, tc.captured)
			}
		})
	}
}

// Without rules nothing is captured: the helpers themselves do not fake a redirect.
func TestNoRulesNoCapture(t *testing.T) {
	testutil.RequireRoot(t)
	pod := traffic.NewPod(t)
	traffic.StartApp(t, pod.PeerNetNS, netip.MustParseAddrPort("[::]:8080"), "peer-app")
	traffic.StartProxy(t, pod.NetNS, traffic.ProxyOptions{})
	a := traffic.Dial(t, pod.NetNS, netip.MustParseAddrPort("10.250.0.1:8080"), traffic.DialOptions{Cred: appUser})
	if a.App == nil || a.Proxy != nil {
		t.Fatalf("want the app directly, got %+v", a.ProbeResult)
	}
	// Nothing listens on the peer's 9999: refused, bounded.
	a = traffic.Dial(t, pod.NetNS, netip.MustParseAddrPort("10.250.0.1:9999"), traffic.DialOptions{Cred: appUser, Timeout: time.Second})
	if a.Connected || a.Error == "" {
		t.Fatalf("want a refused connection, got %+v", a.ProbeResult)
	}
}

// The TPROXY inbound listener needs IP_TRANSPARENT: granted through the ambient
// CAP_NET_ADMIN, it starts as UID 1337.
func TestTPROXYListenerAsProxyUID(t *testing.T) {
	testutil.RequireRoot(t)
	pod := traffic.NewPod(t)
	p := traffic.StartProxy(t, pod.NetNS, traffic.ProxyOptions{TPROXY: true})
	r := p.Records()[0]
	if r.Event != proxysim.EventReady || r.UID != traffic.ProxyUID {
		t.Fatalf("ready record %+v", r)
	}
}
