package e2e

import (
	"context"
	"net/netip"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/internal/env/istio"
	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/standin/proxysim"
)

const (
	annNamespace = "istio-e2e-annotations"
	otherPort    = 9090 // a second echo container's port
	// proxyConfigDNS turns on pilot-agent's DNS proxy (15053) for one pod.
	proxyConfigDNS = `{"proxyMetadata":{"ISTIO_META_DNS_CAPTURE":"true"}}`
)

// TestIstioAnnotations: per-pod annotations go through the real injector and
// meshcni applies what they say, each shown with real packets:
//   - excludeOutboundPorts: a connection to that port bypasses the client's 15001 and
//     reaches the server directly, while another port is captured;
//   - includeInboundPorts: only the listed port is captured on the server's 15006;
//   - interceptionMode TPROXY: the injector gives istio-proxy NET_ADMIN (root, GID
//     1337), istio-validation runs `-m TPROXY` and passes, and an inbound connection
//     is taken by the transparent listener with its original destination intact;
//   - ISTIO_META_DNS_CAPTURE (proxy.istio.io/config): a UDP query to a resolver
//     address is answered by the real pilot-agent's DNS proxy from istiod's name
//     table, where the same query from a pod without it is refused.
func TestIstioAnnotations(t *testing.T) {
	tb := upParallel(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	injectedNamespace(ctx, t, tb, annNamespace)
	pods, took := createDeployments(ctx, t, tb,
		appDeployment(annNamespace, "plain", nil),
		appDeployment(annNamespace, "client-x", map[string]string{
			"traffic.sidecar.istio.io/excludeOutboundPorts": "9090",
			"proxy.istio.io/config":                         proxyConfigDNS,
		}),
		appDeployment(annNamespace, "server-i", map[string]string{"traffic.sidecar.istio.io/includeInboundPorts": "8080"}, otherPort),
		appDeployment(annNamespace, "server-t", map[string]string{"sidecar.istio.io/interceptionMode": "TPROXY"}),
	)
	t.Logf("4 injected pods Ready %s after the Deployments were created", took.Round(time.Millisecond))
	for _, p := range pods {
		if code := initExit(p, "istio-validation"); code != 0 {
			t.Errorf("%s: istio-validation exit %d, want 0", p.Name, code)
		}
	}
	t.Run("excludeOutboundPorts", func(t *testing.T) { checkExcludeOutbound(ctx, t, tb, pods) })
	t.Run("includeInboundPorts", func(t *testing.T) { checkIncludeInbound(ctx, t, tb, pods) })
	t.Run("TPROXY", func(t *testing.T) { checkTPROXY(ctx, t, tb, pods) })
	t.Run("DNS", func(t *testing.T) { checkDNSCapture(ctx, t, tb, pods) })
}

// checkExcludeOutbound: client-x (excludeOutboundPorts 9090) → server-i:9090 is not
// captured by client-x's proxy and server-i (includeInboundPorts 8080) does not
// capture it either, so the echo server sees the probe's own socket address; the
// same pod's connection to server-i:8080 is captured on 15001. The captured probe
// runs second: its record in the log proves the log was read past the first.
func checkExcludeOutbound(ctx context.Context, t *testing.T, tb *testbed.Testbed, pods map[string]*corev1.Pod) {
	client, server := pods["client-x"], pods["server-i"]
	checkArg(t, client, "-o", "9090")
	excluded := podAddr(server, otherPort)
	res := probe(ctx, t, tb, client, excluded)
	if !res.Connected || res.Error != "" {
		t.Fatalf("excluded port: %+v", res)
	}
	if src := replySource(res.Reply); src != res.Local {
		t.Errorf("excluded port: the server saw %v, want the client's own socket %v (no proxy in between)", src, res.Local)
	}
	captured := podAddr(server, istio.AppPort)
	if res := probe(ctx, t, tb, client, captured); !res.Connected || res.Error != "" {
		t.Fatalf("captured port: %+v", res)
	}
	rec, recs := waitRecord(ctx, t, tb, client, "outbound to "+captured.String(), conn(proxysim.ListenerOutbound, captured))
	if rec.Local.Port() != 15001 {
		t.Errorf("captured port: accepted on %v, want :15001", rec.Local)
	}
	none(t, client, recs, "excludeOutboundPorts 9090 (connection to "+excluded.String()+")", conn(proxysim.ListenerOutbound, excluded))
}

// checkIncludeInbound: plain → server-i:9090 goes through plain's 15001 but is not
// captured on server-i's 15006 (includeInboundPorts 8080): the echo server sees
// plain's pod IP, not 127.0.0.6; plain → server-i:8080 is captured there.
func checkIncludeInbound(ctx context.Context, t *testing.T, tb *testbed.Testbed, pods map[string]*corev1.Pod) {
	client, server := pods["plain"], pods["server-i"]
	checkArg(t, server, "-b", "8080")
	clientIP := netip.MustParseAddr(client.Status.PodIP)
	other := podAddr(server, otherPort)
	res := probe(ctx, t, tb, client, other)
	if !res.Connected || res.Error != "" {
		t.Fatalf("port %d: %+v", otherPort, res)
	}
	if src := replySource(res.Reply); src.Addr() != clientIP {
		t.Errorf("port %d: the server saw %v, want the client's pod IP %v (not captured inbound)", otherPort, src, clientIP)
	}
	waitRecord(ctx, t, tb, client, "outbound to "+other.String(), conn(proxysim.ListenerOutbound, other))
	listed := podAddr(server, istio.AppPort)
	res = probe(ctx, t, tb, client, listed)
	if !res.Connected || replySource(res.Reply).Addr() != netip.MustParseAddr("127.0.0.6") {
		t.Errorf("port %d: %+v, want the reply from Istio's inbound passthrough source 127.0.0.6", istio.AppPort, res)
	}
	rec, recs := waitRecord(ctx, t, tb, server, "inbound to "+listed.String()+" from "+clientIP.String(), func(r proxysim.Record) bool {
		return conn(proxysim.ListenerInbound, listed)(r) && r.Peer.Addr() == clientIP
	})
	if rec.Local.Port() != 15006 {
		t.Errorf("port %d: inbound record %+v, want accepted on :15006 from %v", istio.AppPort, rec, clientIP)
	}
	none(t, server, recs, "includeInboundPorts 8080 (connection to "+other.String()+")", conn(proxysim.ListenerInbound, other))
}

// checkTPROXY: what the injector renders for interceptionMode TPROXY, and an
// inbound connection taken by the stand-in's transparent listener: its local
// address is the original destination (not :15006), the peer the client's pod IP.
func checkTPROXY(ctx context.Context, t *testing.T, tb *testbed.Testbed, pods map[string]*corev1.Pod) {
	client, server := pods["plain"], pods["server-t"]
	checkArg(t, server, "-m", "TPROXY")
	px := container(server, istio.ProxyContainer)
	sc := px.SecurityContext
	if sc == nil || sc.Capabilities == nil || !slices.Contains(sc.Capabilities.Add, "NET_ADMIN") ||
		sc.RunAsUser == nil || *sc.RunAsUser != 0 || sc.RunAsGroup == nil || *sc.RunAsGroup != istio.ProxyUID {
		t.Errorf("%s: istio-proxy securityContext %+v: want NET_ADMIN added, runAsUser 0, runAsGroup %d (Istio's TPROXY template)", server.Name, sc, istio.ProxyUID)
	}
	if v := container(server, "istio-validation"); v != nil && v.SecurityContext != nil && v.SecurityContext.Capabilities != nil && len(v.SecurityContext.Capabilities.Add) > 0 {
		t.Errorf("%s: istio-validation adds %v", server.Name, v.SecurityContext.Capabilities.Add)
	}
	logs, err := tb.PodLogs(ctx, server.Namespace, server.Name, istio.ProxyContainer)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(standInLog(logs, "envoy stand-in started"), func(l logLine) bool { return l["tproxy"] == true }) {
		t.Errorf("%s: the stand-in did not start in TPROXY mode:\n%s", server.Name, logs)
	}
	dst := podAddr(server, istio.AppPort)
	clientIP := netip.MustParseAddr(client.Status.PodIP)
	res := probe(ctx, t, tb, client, dst)
	if !res.Connected || res.Error != "" || replySource(res.Reply).Addr() != netip.MustParseAddr("127.0.0.6") {
		t.Errorf("probe %+v: want a reply through the server's proxy (from 127.0.0.6)", res)
	}
	rec, _ := waitRecord(ctx, t, tb, server, "inbound to "+dst.String()+" from "+clientIP.String(), func(r proxysim.Record) bool {
		return conn(proxysim.ListenerInbound, dst)(r) && r.Peer.Addr() == clientIP
	})
	if rec.Local != dst || rec.ForwardErr != "" {
		t.Errorf("TPROXY inbound record %+v: want the transparent socket's local address = original destination %v, peer %v, forwarded", rec, dst, clientIP)
	}
	t.Logf("TPROXY: accepted on %v (original destination) from %v, forwarded from %v", rec.Local, rec.Peer, rec.ForwardSource)
}

// checkDNSCapture: client-x's UDP query to the node IP:53 (no server listens there)
// is answered by its pilot-agent from istiod's name table with istiod's ClusterIP;
// the same query from plain (no DNS capture) is not answered.
func checkDNSCapture(ctx context.Context, t *testing.T, tb *testbed.Testbed, pods map[string]*corev1.Pod) {
	svc, err := tb.Client.CoreV1().Services(istio.Namespace).Get(ctx, istio.IstiodName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	want := netip.MustParseAddr(svc.Spec.ClusterIP)
	name := istio.IstiodHost + ".cluster.local"
	resolver := netip.AddrPortFrom(netip.MustParseAddr(testbed.NodeIP), 53)
	if px := container(pods["client-x"], istio.ProxyContainer); !slices.ContainsFunc(px.Env, func(e corev1.EnvVar) bool {
		return e.Name == "ISTIO_META_DNS_CAPTURE" && e.Value == "true"
	}) {
		t.Errorf("client-x: the injector did not put ISTIO_META_DNS_CAPTURE=true into istio-proxy's env: %+v", px.Env)
	}
	// pilot-agent fills its table from istiod's NDS once the proxy connects; poll.
	var got proxysim.DNSResult
	deadline := time.Now().Add(20 * time.Second)
	for {
		got = dnsQuery(ctx, t, tb, pods["client-x"], resolver, name)
		if slices.Contains(got.Answers, want) || time.Now().After(deadline) {
			break
		}
		time.Sleep(500 * time.Millisecond)
	}
	if got.Error != "" || got.RCode != "Success" || !slices.Contains(got.Answers, want) {
		t.Errorf("captured DNS: %+v, want %s → %v from pilot-agent's DNS proxy", got, name, want)
	}
	if res := dnsQuery(ctx, t, tb, pods["plain"], resolver, name); res.Error == "" || len(res.Answers) > 0 {
		t.Errorf("uncaptured DNS: %+v, want no answer (nothing serves %v)", res, resolver)
	}
}

// checkArg asserts that the pod's injected istio-validation has flag followed by value.
func checkArg(t *testing.T, p *corev1.Pod, flag, value string) {
	t.Helper()
	v := container(p, "istio-validation")
	if v == nil {
		t.Fatalf("%s: no istio-validation", p.Name)
	}
	i := slices.Index(v.Args, flag)
	if i < 0 || i+1 >= len(v.Args) || v.Args[i+1] != value {
		t.Errorf("%s: istio-validation args %q: want %s %s (the annotation through the injector)", p.Name, v.Args, flag, value)
	}
}
