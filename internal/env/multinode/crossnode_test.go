package multinode_test

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/meshcni/meshcni/internal/env/demo"
	"github.com/meshcni/meshcni/internal/standin/proxysim"
)

// TestCrossNodeMeshedTraffic: a meshed client on node A talks to a meshed server on
// node B, through both stand-in proxies (UID 1337, reading SO_ORIGINAL_DST): the
// client app's connection is captured on A by its proxy's 15001 with the original
// destination B's pod IP:port; the proxy's own connection to B leaves A from the
// client's pod IP (UID 1337 is exempt) and is captured on B by the server's proxy on
// 15006 with the same original destination, which hands it to the app from
// 127.0.0.6. A plain client on A reaching the meshed server is captured on B's 15006
// only. Plain pods across the two nodes talk directly: the plain server sees the
// plain client's pod IP, no proxy records the connection, and neither plain pod's
// netns holds a meshcni rule.
func TestCrossNodeMeshedTraffic(t *testing.T) {
	c := cluster(t)
	tb := c.TB
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	nodes := tb.Nodes()
	if len(nodes) < 3 {
		t.Fatalf("the package's cluster has %d nodes, want 3", len(nodes))
	}
	a, b := nodes[1], nodes[2]
	ns := namespace(t, c, "mn-cross")
	pods := startPods(ctx, t, tb,
		c.MeshedPod(ns, "meshed-client", a.Name),
		c.MeshedPod(ns, "meshed-server", b.Name),
		demoPod(c, demo.PlainPod, ns, "plain-client", a.Name),
		demoPod(c, demo.PlainPod, ns, "plain-server", b.Name),
	)
	mc, ms, pc, ps := pods["meshed-client"], pods["meshed-server"], pods["plain-client"], pods["plain-server"]
	for _, p := range pods {
		want := map[string]string{"meshed-client": a.Name, "plain-client": a.Name, "meshed-server": b.Name, "plain-server": b.Name}[p.Name]
		if p.Spec.NodeName != want {
			t.Fatalf("%s runs on %s, want %s", p.Name, p.Spec.NodeName, want)
		}
	}
	for _, p := range []string{"meshed-client", "meshed-server"} {
		redirected(ctx, t, c, pods[p])
	}
	clientIP := podAddr(t, mc, 0).Addr()

	t.Run("meshed to meshed", func(t *testing.T) {
		out, in, res := meshedPath(ctx, t, tb, mc, ms)
		dst := podAddr(t, ms, demo.AppPort)
		if out.UID != demo.ProxyUID || out.Forward != dst || out.ForwardSource.Addr() != clientIP {
			t.Errorf("on %s: the client's proxy (uid %d) forwarded to %v from %v; want uid %d, to %v from the client's pod IP %v (no NAT between nodes)",
				a.Name, out.UID, out.Forward, out.ForwardSource, demo.ProxyUID, dst, clientIP)
		}
		if seen := appPeer(t, res); seen.Addr() != netip.MustParseAddr("127.0.0.6") {
			t.Errorf("the server app saw the connection from %v, want 127.0.0.6 (its proxy's inbound passthrough)", seen)
		}
		t.Logf("%s (%s) → %v: captured on %s by %v with original destination %v, forwarded from %v; captured on %s by %v with original destination %v",
			mc.Name, a.Name, dst, a.Name, out.Local, out.OrigDst, out.ForwardSource, b.Name, in.Local, in.OrigDst)
	})

	t.Run("plain to meshed", func(t *testing.T) {
		dst := podAddr(t, ms, demo.AppPort)
		res := probeFrom(ctx, t, tb, pc, demo.AppContainer, dst)
		in := connRecord(ctx, t, tb, ms, proxysim.ListenerInbound, res.Local)
		if in.Local.Port() != 15006 || in.OrigDst != dst {
			t.Errorf("on %s: the server's proxy record %+v; want local port 15006 and original destination %v", b.Name, in, dst)
		}
		if res.Local.Addr() != podAddr(t, pc, 0).Addr() {
			t.Errorf("the plain client's connection left from %v, want its pod IP %s", res.Local, pc.Status.PodIP)
		}
	})

	t.Run("plain to plain", func(t *testing.T) {
		dst := podAddr(t, ps, demo.AppPort)
		res := probeFrom(ctx, t, tb, pc, demo.AppContainer, dst)
		if seen := appPeer(t, res); seen != res.Local || seen.Addr() != podAddr(t, pc, 0).Addr() {
			t.Errorf("the plain server on %s saw the connection from %v; want the plain client's own address %v (pod IP %s, no NAT, no proxy)",
				b.Name, seen, res.Local, pc.Status.PodIP)
		}
		// No proxy on either node recorded it, and neither pod has a rule of meshcni.
		for _, p := range []string{"meshed-client", "meshed-server"} {
			for _, r := range connsFrom(ctx, tb, pods[p], res.Local.Addr()) {
				if r.Peer == res.Local {
					t.Errorf("%s's proxy captured the plain pods' connection: %+v", p, r)
				}
			}
		}
		for _, p := range []string{"plain-client", "plain-server"} {
			if live := liveRules(ctx, t, tb, pods[p]); live != "" {
				t.Errorf("%s on %s (no sidecar) holds meshcni rules:\n%s", p, pods[p].Spec.NodeName, live)
			}
		}
	})
}
