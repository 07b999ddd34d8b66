package sockmap_test

import (
	"net/netip"
	"testing"
	"time"

	"github.com/meshcni/meshcni/internal/proxysim"
	"github.com/meshcni/meshcni/internal/traffic"
)

// TestAcceleratedHops: in an opted-in meshed pod, app → proxy (outbound, after
// REDIRECT to 15001) and proxy → app (inbound, from 127.0.0.6 / ::6 after
// REDIRECT to 15006) are redirected by sk_msg, the proxy records the right
// original destination, 4 MiB echo byte-exact through app → proxy → peer, and
// only the hop's two sockets are recorded.
func TestAcceleratedHops(t *testing.T) {
	a, _ := load(t)
	p := newPod(t)
	if err := a.Enable(cookie(t, p.NetNS), traffic.ProxyUID); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name     string
		from     string
		dst      netip.AddrPort
		listener string
	}{
		{"outbound v4", p.NetNS, peer4, proxysim.ListenerOutbound},
		{"outbound v6", p.NetNS, peer6, proxysim.ListenerOutbound},
		{"inbound v4", p.PeerNetNS, pod4, proxysim.ListenerInbound},
		{"inbound v6", p.PeerNetNS, pod6, proxysim.ListenerInbound},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before := stats(t, a)
			c := dial(t, tc.from, tc.dst)
			local := c.LocalAddr().String()
			roundTrip(t, c, 4<<20)
			rec := p.proxy.WaitRecord(t, 5*time.Second, func(r proxysim.Record) bool {
				return r.Event == proxysim.EventConn && r.Listener == tc.listener && r.OrigDst == tc.dst
			})
			after := stats(t, a)
			t.Logf("%s from %s: record %+v; stats %+v → %+v", tc.name, local, rec, before, after)
			if after.Messages == before.Messages || after.Bytes-before.Bytes < 4<<20 {
				t.Errorf("want ≥ 4 MiB redirected by sk_msg, got %d messages, %d bytes", after.Messages-before.Messages, after.Bytes-before.Bytes)
			}
			// The two ends of the hop, not the proxy's socket facing the network.
			if got := after.Recorded - before.Recorded; got != 2 {
				t.Errorf("recorded %d sockets, want the hop's 2", got)
			}
		})
	}
}
