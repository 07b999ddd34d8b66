package nftables_test

import (
	"context"
	"fmt"
	"net/netip"
	"testing"

	"github.com/meshcni/meshcni/internal/testkit/nfttest"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/backend/nftables"
	"github.com/meshcni/meshcni/pkg/rules/nft"
	"github.com/meshcni/meshcni/pkg/spec"
)

// TestApplyDocumentedMaxima: the largest specs the parsers accept (spec.MaxListItems
// ports or prefixes in a list) apply through the netlink backend, without error, and
// leave what `nft -f` of the rendered script leaves. (With a netlink socket's default
// buffers such a batch fails: EMSGSIZE on send, or ENOBUFS on the acknowledgements of
// a batch that committed; see SocketBuffer.)
func TestApplyDocumentedMaxima(t *testing.T) {
	nfttest.Require(t)
	ports := func(from int) []uint16 {
		var ps []uint16
		for i := range spec.MaxListItems {
			ps = append(ps, uint16(from+i))
		}
		return ps
	}
	var cidrs []netip.Prefix
	for i := range spec.MaxListItems {
		cidrs = append(cidrs, netip.MustParsePrefix(fmt.Sprintf("10.%d.%d.0/24", i/256, i%256)))
	}
	inbound := podDefaults()
	inbound.InboundPorts = spec.PortSet{Ports: ports(20000)}
	inbound.InboundPortsExclude = ports(30000)
	outbound := podDefaults()
	outbound.OutboundIPRangesExclude = cidrs
	outbound.OutboundPortsExclude = ports(40000)
	tproxy := podDefaults()
	tproxy.Mode = spec.ModeTProxy
	tproxy.InboundPorts = spec.PortSet{Ports: ports(20000)}
	for name, s := range map[string]*spec.Spec{"inbound ports": inbound, "outbound cidrs and ports": outbound, "tproxy inbound ports": tproxy} {
		t.Run(name, func(t *testing.T) {
			rs := build(t, s)
			mine, theirs := testutil.NewNetns(t), testutil.NewNetns(t)
			if err := nftables.New().Apply(context.Background(), mine, rs); err != nil {
				t.Fatalf("apply: %v", err)
			}
			nfttest.Load(t, theirs, nft.Render(rs))
			if d := nfttest.Diff(nfttest.Parse(nfttest.List(t, theirs)), nfttest.Parse(nfttest.List(t, mine))); d != "" {
				t.Errorf("netlink apply differs from nft -f of the rendered script:\n%s", d)
			}
		})
	}
}

// TestApplyReadsBackAfterAnError: when the batch commits but its acknowledgements
// overflow the receive buffer (ENOBUFS), the backend reads the namespace back: the
// ruleset is in place, so Apply succeeds — it never says "nothing was changed" while
// the rules are there.
func TestApplyReadsBackAfterAnError(t *testing.T) {
	nfttest.Require(t)
	defer nftables.SetReceiveBuffer(2048)()
	s := podDefaults()
	s.InboundPorts = spec.PortSet{Ports: func() []uint16 {
		var ps []uint16
		for i := range spec.MaxListItems {
			ps = append(ps, uint16(20000+i))
		}
		return ps
	}()}
	rs := build(t, s)
	mine, theirs := testutil.NewNetns(t), testutil.NewNetns(t)
	if err := nftables.New().Apply(context.Background(), mine, rs); err != nil {
		t.Fatalf("apply: %v (the batch committed: the error must not stand)", err)
	}
	nfttest.Load(t, theirs, nft.Render(rs))
	if d := nfttest.Diff(nfttest.Parse(nfttest.List(t, theirs)), nfttest.Parse(nfttest.List(t, mine))); d != "" {
		t.Errorf("namespace differs from the ruleset:\n%s", d)
	}
}
