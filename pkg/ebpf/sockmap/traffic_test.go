package sockmap_test

import (
	"context"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/meshcni/meshcni/internal/standin/proxysim"
	"github.com/meshcni/meshcni/internal/testkit/traffic"
	"github.com/meshcni/meshcni/pkg/ebpf/sockmap"
	"github.com/meshcni/meshcni/pkg/engine"
	"github.com/meshcni/meshcni/pkg/spec"
)

// TestAcceleratedHops: in an opted-in meshed pod, app → proxy (outbound, after
// REDIRECT to 15001) and proxy → app (inbound, from 127.0.0.6 / ::6 after
// REDIRECT to 15006) are redirected by sk_msg, the proxy records the right
// original destination, 4 MiB echo byte-exact through app → proxy → peer, and
// only the hop's two sockets are recorded.
func TestAcceleratedHops(t *testing.T) {
	a, _ := load(t)
	p := newPod(t)
	if err := a.Enable(cookie(t, p.NetNS), sockmap.Pod{ProxyUID: traffic.ProxyUID, ToApp: true}); err != nil {
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

// TestShortConnections: 200 connections each way that write their one request
// byte right after connect: each connection's hop is recorded, and each of
// its two messages on the hop is either redirected or passed to TCP (a miss:
// the app wrote before the proxy's end was established) — never dropped, the
// byte comes back.
func TestShortConnections(t *testing.T) {
	a, _ := load(t)
	p := newPod(t)
	if err := a.Enable(cookie(t, p.NetNS), sockmap.Pod{ProxyUID: traffic.ProxyUID, ToApp: true}); err != nil {
		t.Fatal(err)
	}
	const n = 200
	for _, tc := range []struct {
		name, from string
		dst        netip.AddrPort
	}{{"outbound", p.NetNS, peer4}, {"inbound", p.PeerNetNS, pod4}} {
		before := stats(t, a)
		for i := range n {
			c := dial(t, tc.from, tc.dst)
			_ = c.SetDeadline(time.Now().Add(10 * time.Second))
			b := []byte{byte(i)}
			if _, err := c.Write(b); err != nil {
				t.Fatal(err)
			}
			if _, err := io.ReadFull(c, b); err != nil || b[0] != byte(i) {
				t.Fatalf("%s connection %d: echo %v, %v", tc.name, i, b, err)
			}
			c.Close()
		}
		after := stats(t, a)
		rec, msgs, misses := after.Recorded-before.Recorded, after.Messages-before.Messages, after.Misses-before.Misses
		t.Logf("%s: %d connections, %d sockets recorded, %d messages redirected, %d misses", tc.name, n, rec, msgs, misses)
		if rec != 2*n {
			t.Errorf("%s: %d sockets recorded, want %d (each connection's hop)", tc.name, rec, 2*n)
		}
		if msgs+misses != 2*n {
			t.Errorf("%s: %d redirected + %d missed messages, want %d (request and reply on each hop)", tc.name, msgs, misses, 2*n)
		}
	}
}

// TestTPROXYInbound: with inbound capture by TPROXY, the proxy's transparent
// socket (facing the network) is left alone and its dial to the app from
// 127.0.0.6 / ::6 is accelerated, byte-exact, with the original destination
// recorded.
func TestTPROXYInbound(t *testing.T) {
	a, _ := load(t)
	p := &pod{Pod: traffic.NewPod(t)}
	startEcho(t, p.NetNS, "[::]:9090")
	s := spec.PodDefaults()
	s.EnableIPv6 = true
	s.Mode = spec.ModeTProxy
	if _, err := engine.Apply(context.Background(), engine.Options{NetnsPath: p.NetNS}, &s); err != nil {
		t.Fatalf("apply the redirect: %v", err)
	}
	p.proxy = traffic.StartProxy(t, p.NetNS, traffic.ProxyOptions{TPROXY: true, Args: []string{
		"--mode=forward", "--no-splice", "--inbound-source=127.0.0.6", "--inbound-source-v6=::6", "--log-level=error"}})
	if err := a.Enable(cookie(t, p.NetNS), sockmap.Pod{ProxyUID: traffic.ProxyUID, ToApp: true}); err != nil {
		t.Fatal(err)
	}
	for _, dst := range []netip.AddrPort{pod4, pod6} {
		before := stats(t, a)
		roundTrip(t, dial(t, p.PeerNetNS, dst), 4<<20)
		p.proxy.WaitRecord(t, 5*time.Second, func(r proxysim.Record) bool {
			return r.Listener == proxysim.ListenerInbound && r.OrigDst == dst
		})
		after := stats(t, a)
		if rec := after.Recorded - before.Recorded; rec != 2 || after.Bytes-before.Bytes < 8<<20 {
			t.Errorf("%v: %d sockets recorded (want the hop's 2), %d bytes redirected (want ≥ 8 MiB)", dst, rec, after.Bytes-before.Bytes)
		}
	}
}

// TestToProxyOnlySplicingApp: an app that reads its socket with splice(2) (Go's
// io.Copy between two *net.TCPConn) gets every byte when its pod is enabled
// with the default Pod{} (to the proxy only): the proxy's messages to it go
// through TCP, its own replies to the proxy are redirected. (Enabled with
// ToApp, splice sees only TCP's queue; the test logs what that app then gets.)
func TestToProxyOnlySplicingApp(t *testing.T) {
	a, _ := load(t)
	p := newPod(t)
	ln := listenIn(t, p.NetNS, "[::]:9093")
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				tc := c.(*net.TCPConn)
				_, _ = io.Copy(tc, tc) // TCPConn.ReadFrom(TCPConn): splice(2)
				_ = tc.CloseWrite()
			}()
		}
	}()
	dst := withPort(pod4, 9093)
	ck := cookie(t, p.NetNS)

	if err := a.Enable(ck, sockmap.Pod{ProxyUID: traffic.ProxyUID, ToApp: true}); err != nil {
		t.Fatal(err)
	}
	c := dial(t, p.PeerNetNS, dst)
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	go func() { _, _ = c.Write(make([]byte, 1<<20)); _ = c.CloseWrite() }()
	got, err := io.ReadAll(c)
	t.Logf("enabled with ToApp, a splicing app echoes %d of %d bytes (%v)", len(got), 1<<20, err)

	if err := a.Enable(ck, sockmap.Pod{ProxyUID: traffic.ProxyUID}); err != nil {
		t.Fatal(err)
	}
	before := stats(t, a)
	roundTrip(t, dial(t, p.PeerNetNS, dst), 1<<20)
	after := stats(t, a)
	if b := after.Bytes - before.Bytes; b < 1<<20 || b >= 2<<20 {
		t.Errorf("to-proxy-only: %d bytes redirected, want the app's 1 MiB echo only", b)
	}
}
