package proxysim_test

import (
	"github.com/meshcni/meshcni/internal/testkit/testutil"

	"context"
	"encoding/json"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/meshcni/meshcni/internal/standin/proxysim"
)

func TestConfigErrors(t *testing.T) {
	tests := []struct {
		name string
		cfg  proxysim.Config
	}{
		{"bad mode", proxysim.Config{Mode: "mirror", IPv4: true, OutboundPort: 1}},
		{"no family", proxysim.Config{OutboundPort: 1}},
		{"no listener", proxysim.Config{IPv4: true}},
		{"same ports", proxysim.Config{IPv4: true, OutboundPort: 1, InboundPort: 1}},
		{"v6 listen address for v4", proxysim.Config{IPv4: true, OutboundPort: 1, ListenV4: netip.IPv6Loopback()}},
		{"v6 inbound source for v4", proxysim.Config{IPv4: true, OutboundPort: 1, InboundSourceV4: netip.IPv6Loopback()}},
		{"v4 dns answer for AAAA", proxysim.Config{IPv4: true, OutboundPort: 1, DNSAnswerV6: netip.MustParseAddr("10.0.0.1")}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := proxysim.New(tc.cfg); err == nil {
				t.Fatal("want an error")
			}
		})
	}
}

// start runs a proxy on fixed loopback ports below the kernel's ephemeral range
// (32768-60999), so no concurrent outgoing connection can hold them (no root needed).
func start(t *testing.T, cfg proxysim.Config) (*proxysim.Proxy, func() []proxysim.Record) {
	t.Helper()
	var mu sync.Mutex
	var recs []proxysim.Record
	cfg.OnRecord = func(r proxysim.Record) { mu.Lock(); recs = append(recs, r); mu.Unlock() }
	cfg.ListenV4 = netip.MustParseAddr("127.0.0.1")
	p, err := proxysim.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Listen(); err != nil {
		testutil.Missing(t, "cannot bind test ports on 127.0.0.1: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Serve(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("serve: %v", err)
			}
		case <-time.After(5 * time.Second):
			t.Error("Serve did not return after cancel")
		}
	})
	return p, func() []proxysim.Record { mu.Lock(); defer mu.Unlock(); return append([]proxysim.Record(nil), recs...) }
}

func TestRecordModeWithoutRedirect(t *testing.T) {
	_, recs := start(t, proxysim.Config{IPv4: true, OutboundPort: 29101, InboundPort: 29106})
	res := proxysim.Probe(context.Background(), proxysim.ProbeRequest{Dst: netip.MustParseAddrPort("127.0.0.1:29101"), Send: "x"})
	if !res.Connected || res.Error != "" {
		t.Fatalf("probe: %+v", res)
	}
	var r proxysim.Record
	if err := json.Unmarshal([]byte(res.Reply), &r); err != nil {
		t.Fatalf("reply %q: %v", res.Reply, err)
	}
	// Not redirected: no original destination is invented.
	if r.Listener != proxysim.ListenerOutbound || (r.OrigDst.IsValid() && r.OrigDst != r.Local) {
		t.Fatalf("record %+v", r)
	}
	if got := recs(); len(got) < 2 || got[0].Event != proxysim.EventReady {
		t.Fatalf("records %+v", got)
	}
}

func TestForwardRefusesToLoop(t *testing.T) {
	_, recs := start(t, proxysim.Config{Mode: proxysim.ModeForward, IPv4: true, OutboundPort: 29201})
	res := proxysim.Probe(context.Background(), proxysim.ProbeRequest{Dst: netip.MustParseAddrPort("127.0.0.1:29201"), Timeout: 2 * time.Second})
	if res.Reply != "" {
		t.Fatalf("a non-redirected connection was answered: %+v", res)
	}
	deadline := time.Now().Add(2 * time.Second)
	for time.Now().Before(deadline) {
		for _, r := range recs() {
			if r.Event == proxysim.EventConn {
				if r.ForwardErr == "" {
					t.Fatalf("forwarded a connection to itself: %+v", r)
				}
				return
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatal("no connection record")
}

func TestDNS(t *testing.T) {
	_, recs := start(t, proxysim.Config{IPv4: true, DNSPort: 29353,
		DNSAnswerV4: netip.MustParseAddr("10.9.9.9"), DNSAnswerV6: netip.MustParseAddr("fd00::9")})
	server := netip.MustParseAddrPort("127.0.0.1:29353")
	tests := []struct {
		name string
		typ  string
		tcp  bool
		want string
	}{
		{"A over udp", "A", false, "10.9.9.9"},
		{"A over tcp", "A", true, "10.9.9.9"},
		{"AAAA over udp", "AAAA", false, "fd00::9"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			typ, err := proxysim.ParseDNSType(tc.typ)
			if err != nil {
				t.Fatal(err)
			}
			name := strings.ReplaceAll(tc.name, " ", "-") + ".example"
			res := proxysim.QueryDNS(context.Background(), proxysim.DNSRequest{Server: server, Name: name, Type: typ, TCP: tc.tcp})
			if res.Error != "" || res.RCode != "Success" || len(res.Answers) != 1 || res.Answers[0].String() != tc.want {
				t.Fatalf("result %+v, want %s", res, tc.want)
			}
			found := false
			for _, r := range recs() {
				found = found || (r.Event == proxysim.EventDNS && r.Query == name+"." && r.QueryType == tc.typ)
			}
			if !found {
				t.Fatalf("query not recorded: %+v", recs())
			}
		})
	}
}
