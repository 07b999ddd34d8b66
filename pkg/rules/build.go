package rules

import (
	"net/netip"
	"strconv"

	"github.com/meshcni/meshcni/pkg/spec"
)

// Fixed prefixes, built from their bytes rather than parsed: the CNI plugin links
// this package and runs its initialisation at every start.
var (
	v6Loopback   = netip.PrefixFrom(netip.AddrFrom16([16]byte{15: 1}), 128)     // ::1/128
	v4Passthru   = netip.PrefixFrom(netip.AddrFrom4([4]byte{127, 0, 0, 6}), 32) // 127.0.0.6/32
	v6Passthru   = netip.PrefixFrom(netip.AddrFrom16([16]byte{15: 6}), 128)     // ::6/128
	dnsPort      = []uint16{53}
	dnsTCPExempt = PortMatch{Ports: dnsPort, Neg: true}
)

// builder records operations in generation order, per table.
type builder struct {
	s  *spec.Spec
	rs *Ruleset
}

func (b *builder) table(name string) *Table {
	if t := b.rs.Table(name); t != nil {
		return t
	}
	t := &Table{Name: name}
	b.rs.Tables = append(b.rs.Tables, t)
	return t
}

func (b *builder) add(table, chain string, r Rule) {
	if r.Family == 0 {
		r.Family = Both
	}
	t := b.table(table)
	t.Ops = append(t.Ops, Op{Chain: chain, Rule: r})
}

func (b *builder) insert(table, chain string, pos int, r Rule) {
	if r.Family == 0 {
		r.Family = Both
	}
	t := b.table(table)
	t.Ops = append(t.Ops, Op{Chain: chain, Insert: true, Pos: pos, Rule: r})
}

// addVersioned appends the rule twice, once per family, with the family's prefix
// filled in by set (Istio's "versioned" rules: loopback and passthrough addresses).
func (b *builder) addVersioned(table, chain string, v4, v6 netip.Prefix, set func(*Rule, netip.Prefix), r Rule) {
	r4, r6 := r, r
	r4.Family, r6.Family = V4, V6
	set(&r4, v4)
	set(&r6, v6)
	b.add(table, chain, r4)
	b.add(table, chain, r6)
}

func setDst(neg bool) func(*Rule, netip.Prefix) {
	return func(r *Rule, p netip.Prefix) { r.Match.Dst = PrefixMatch{Prefix: p, Neg: neg} }
}

func setSrc(r *Rule, p netip.Prefix) { r.Match.Src = PrefixMatch{Prefix: p} }

func family(p netip.Prefix) Family {
	if p.Addr().Is4() {
		return V4
	}
	return V6
}

func uidOwner(id uint32, neg bool) []OwnerMatch {
	return []OwnerMatch{{UID: &id, Neg: neg}}
}

func gidOwner(id uint32, neg bool) []OwnerMatch {
	return []OwnerMatch{{Group: strconv.FormatUint(uint64(id), 10), Neg: neg}}
}

// proxyOwners lists one owner match per proxy UID, then per proxy GID, in Istio's order.
func proxyOwners(s *spec.Spec) [][]OwnerMatch {
	owners := make([][]OwnerMatch, 0, len(s.ProxyUIDs)+len(s.ProxyGIDs))
	for _, uid := range s.ProxyUIDs {
		owners = append(owners, uidOwner(uid, false))
	}
	for _, gid := range s.ProxyGIDs {
		owners = append(owners, gidOwner(gid, false))
	}
	return owners
}

func jump(chain string) Verdict { return Verdict{Kind: Jump, Chain: chain} }

var ret = Verdict{Kind: Return}

// Build renders a validated spec into the desired ruleset. It follows the order in
// which Istio's generator emits rules, so that the result, loaded into a kernel,
// reads back equal to Istio's (see docs/conformance.md).
func Build(s *spec.Spec) *Ruleset {
	rs := &Ruleset{}
	if s.EnableIPv4 {
		rs.Families |= V4
	}
	if s.IPv6Captured() {
		rs.Families |= V6
		rs.IPv6Loopback = true
	}
	b := &builder{s: s, rs: rs}
	tproxy := s.Mode == spec.ModeTProxy
	dns := s.DNSEnabled()

	// Interfaces that are never captured.
	for _, ifc := range s.ExcludeInterfaces {
		b.add(TableNat, ChainPrerouting, Rule{Match: Match{In: IfaceMatch{Name: ifc}}, Verdict: ret})
		b.add(TableNat, ChainOutput, Rule{Match: Match{Out: IfaceMatch{Name: ifc}}, Verdict: ret})
	}
	if tproxy {
		for _, ifc := range s.ExcludeInterfaces {
			b.add(TableMangle, ChainPrerouting, Rule{Match: Match{In: IfaceMatch{Name: ifc}}, Verdict: ret})
			b.add(TableMangle, ChainOutput, Rule{Match: Match{Out: IfaceMatch{Name: ifc}}, Verdict: ret})
		}
	}
	// Virtual interfaces: not captured as inbound.
	for _, ifc := range s.RerouteInterfaces {
		b.insert(TableNat, ChainPrerouting, 1, Rule{Match: Match{In: IfaceMatch{Name: ifc}}, Verdict: ret})
	}
	if s.DropInvalid {
		// Istio's iptables generator drops every invalid packet, its nftables generator
		// invalid TCP only; each view matches its generator.
		b.add(TableMangle, ChainPrerouting, Rule{Scope: IptablesViews, Match: Match{CTState: CTInvalid}, Verdict: jump(ChainDrop)})
		b.add(TableMangle, ChainPrerouting, Rule{Scope: InetView, Match: Match{Proto: TCP, CTState: CTInvalid}, Verdict: jump(ChainDrop)})
		b.add(TableMangle, ChainDrop, Rule{Verdict: Verdict{Kind: Drop}})
	}

	b.add(TableNat, ChainInbound, Rule{Match: Match{Proto: TCP, DPorts: PortMatch{Ports: []uint16{s.InboundTunnelPort}}}, Verdict: ret,
		Comment: "the tunnel port is never captured inbound"})
	b.add(TableNat, ChainRedirect, Rule{Match: Match{Proto: TCP}, Verdict: Verdict{Kind: Redirect, Port: s.ProxyPort}})
	b.add(TableNat, ChainInRedirect, Rule{Match: Match{Proto: TCP}, Verdict: Verdict{Kind: Redirect, Port: s.InboundCapturePort}})

	b.inbound()

	b.add(TableNat, ChainOutput, Rule{Verdict: jump(ChainOutputChain)})
	for _, p := range s.OutboundPortsExclude {
		for _, proto := range []Proto{TCP, UDP} {
			b.add(TableNat, ChainOutputChain, Rule{Match: Match{Proto: proto, DPorts: PortMatch{Ports: []uint16{p}}}, Verdict: ret})
		}
	}
	b.addVersioned(TableNat, ChainOutputChain, v4Passthru, v6Passthru, setSrc,
		Rule{Match: Match{Out: IfaceMatch{Name: "lo"}}, Verdict: ret, Comment: "inbound passthrough from the proxy"})

	loopbackIncluded := s.OutboundIPRanges.HasLoopback()
	owners := proxyOwners(s)
	for i, own := range owners {
		isUID := i < len(s.ProxyUIDs)
		notOwn := []OwnerMatch{own[0]}
		notOwn[0].Neg = true
		// The proxy calling the app through a service VIP over lo: back to inbound.
		dports := PortMatch{Ports: []uint16{s.InboundTunnelPort}, Neg: true}
		if dns && isUID {
			dports = PortMatch{Ports: []uint16{53, s.InboundTunnelPort}, Neg: true}
		}
		b.addVersioned(TableNat, ChainOutputChain, s.HostLoopback, v6Loopback, setDst(true),
			Rule{Match: Match{Proto: TCP, Out: IfaceMatch{Name: "lo"}, DPorts: dports, Owners: own}, Verdict: jump(ChainInRedirect)})
		// The app calling itself over lo: not captured.
		if !loopbackIncluded {
			if dns {
				b.add(TableNat, ChainOutputChain, Rule{Match: Match{Proto: TCP, Out: IfaceMatch{Name: "lo"}, DPorts: dnsTCPExempt, Owners: notOwn}, Verdict: ret})
			} else {
				b.add(TableNat, ChainOutputChain, Rule{Match: Match{Out: IfaceMatch{Name: "lo"}, Owners: notOwn}, Verdict: ret})
			}
		}
		// The proxy's own traffic is never captured.
		b.add(TableNat, ChainOutputChain, Rule{Match: Match{Owners: own}, Verdict: ret, Comment: "the proxy's own traffic"})
	}

	b.ownerGroups()
	if dns {
		b.dns()
	}

	b.addVersioned(TableNat, ChainOutputChain, s.HostLoopback, v6Loopback, setDst(false),
		Rule{Verdict: ret, Comment: "localhost is not captured"})
	for _, p := range s.OutboundIPRangesExclude {
		b.add(TableNat, ChainOutputChain, Rule{Family: family(p), Match: Match{Dst: PrefixMatch{Prefix: p}}, Verdict: ret})
	}
	for _, p := range s.OutboundPorts {
		b.add(TableNat, ChainOutputChain, Rule{Match: Match{Proto: TCP, DPorts: PortMatch{Ports: []uint16{p}}}, Verdict: jump(ChainRedirect)})
	}
	b.outboundInclude()

	if tproxy {
		b.tproxyMarks()
		if !s.InboundPorts.Empty() { // nothing inbound captured: no routing, as Istio
			rs.Route = &PolicyRoute{Mark: s.TProxyMark, Table: s.TProxyRouteTable}
		}
	}
	b.uncaptured()
	return rs
}

// uncaptured writes what happens to a family whose capture rules are not written,
// so that every backend treats it alike. The iptables backends hold one set of
// tables per family: with no rule for a family its traffic passes uncaptured, as
// under istio-iptables. The inet view (native nftables) holds both families, and a
// capture rule without an address applies to either, so each of its base chains
// starts by letting the uncaptured family pass (`meta nfproto ipv6 return`). With
// IPv6 mode drop, IPv6 goes first through ISTIO_IPV6_DROP_IN / _OUT (mangle
// PREROUTING / OUTPUT) in every view: ip6tables' and the inet table's.
func (b *builder) uncaptured() {
	for _, f := range []Family{V4, V6} {
		if b.rs.Families.Has(f) {
			continue
		}
		b.passGuards(f)
		if f == V6 && b.s.IPv6 == spec.IPv6Drop {
			b.dropIPv6()
		}
	}
}

// passGuards puts `meta nfproto f return` first in every base chain of the inet view.
func (b *builder) passGuards(f Family) {
	for _, t := range b.rs.Tables {
		for _, c := range inetBaseChains(t, b.rs.Families) {
			b.insert(t.Name, c, 1, Rule{Family: f, Scope: InetView, Uncaptured: true, Match: Match{NFProto: f}, Verdict: ret,
				Comment: "the family's capture rules are not written: it passes, as with iptables"})
		}
	}
}

// inetBaseChains lists the base chains of t that hold a rule in the inet view (a
// conditional jump counts when its target holds one), without resolving the view.
func inetBaseChains(t *Table, captured Family) []string {
	has := map[string]bool{}
	for _, op := range t.Ops {
		if !op.Rule.IfTargetNonEmpty && op.Rule.inView(Both, captured, true) {
			has[op.Chain] = true
		}
	}
	for _, op := range t.Ops {
		if op.Rule.IfTargetNonEmpty && op.Rule.inView(Both, captured, true) && has[op.Rule.Verdict.Chain] {
			has[op.Chain] = true
		}
	}
	var out []string
	for _, c := range []string{ChainPrerouting, ChainOutput} {
		if has[c] {
			out = append(out, c)
		}
	}
	return out
}

// dropIPv6 drops uncaptured IPv6 but what must pass: lo, ICMPv6 (neighbour
// discovery), the proxy's own outbound traffic, and established or related flows
// (the replies to it).
func (b *builder) dropIPv6() {
	v6 := func(m Match, v Verdict) Rule { return Rule{Family: V6, Uncaptured: true, Match: m, Verdict: v} }
	established := Match{CTState: CTRelated | CTEstablished}
	icmp := Match{Proto: ICMPv6}
	drop := Verdict{Kind: Drop}
	b.insert(TableMangle, ChainPrerouting, 1, v6(Match{NFProto: V6}, jump(ChainIPv6DropIn)))
	b.insert(TableMangle, ChainOutput, 1, v6(Match{NFProto: V6}, jump(ChainIPv6DropOut)))
	for _, m := range []Match{{In: IfaceMatch{Name: "lo"}}, icmp, established} {
		b.add(TableMangle, ChainIPv6DropIn, v6(m, ret))
	}
	b.add(TableMangle, ChainIPv6DropIn, v6(Match{}, drop))
	for _, m := range []Match{{Out: IfaceMatch{Name: "lo"}}, icmp, established} {
		b.add(TableMangle, ChainIPv6DropOut, v6(m, ret))
	}
	for _, own := range proxyOwners(b.s) {
		b.add(TableMangle, ChainIPv6DropOut, v6(Match{Owners: own}, ret))
	}
	b.add(TableMangle, ChainIPv6DropOut, v6(Match{}, drop))
}

func (b *builder) inbound() {
	s := b.s
	if s.InboundPorts.Empty() {
		return
	}
	table := TableNat
	if s.Mode == spec.ModeTProxy {
		table = TableMangle
		b.add(TableMangle, ChainDivert, Rule{Verdict: Verdict{Kind: SetMark, Mark: s.TProxyMark}})
		b.add(TableMangle, ChainDivert, Rule{Verdict: Verdict{Kind: Accept}})
		b.addVersioned(TableMangle, ChainTProxy, s.HostLoopback, v6Loopback, setDst(true),
			Rule{Match: Match{Proto: TCP}, Verdict: Verdict{Kind: TProxy, Port: s.InboundCapturePort, Mark: s.TProxyMark}})
	}
	b.add(table, ChainPrerouting, Rule{Match: Match{Proto: TCP}, Verdict: jump(ChainInbound)})
	established := Match{Proto: TCP, CTState: CTRelated | CTEstablished}
	if s.InboundPorts.All {
		for _, p := range s.InboundPortsExclude {
			b.add(table, ChainInbound, Rule{Match: Match{Proto: TCP, DPorts: PortMatch{Ports: []uint16{p}}}, Verdict: ret})
		}
		if table == TableMangle {
			b.add(TableMangle, ChainInbound, Rule{Match: established, Verdict: jump(ChainDivert)})
			b.add(TableMangle, ChainInbound, Rule{Match: Match{Proto: TCP}, Verdict: jump(ChainTProxy)})
		} else {
			b.add(TableNat, ChainInbound, Rule{Match: Match{Proto: TCP}, Verdict: jump(ChainInRedirect)})
		}
		return
	}
	for _, p := range s.InboundPorts.Ports {
		port := PortMatch{Ports: []uint16{p}}
		if table == TableMangle {
			m := established
			m.DPorts = port
			b.add(TableMangle, ChainInbound, Rule{Match: m, Verdict: jump(ChainDivert)})
			b.add(TableMangle, ChainInbound, Rule{Match: Match{Proto: TCP, DPorts: port}, Verdict: jump(ChainTProxy)})
		} else {
			b.add(TableNat, ChainInbound, Rule{Match: Match{Proto: TCP, DPorts: port}, Verdict: jump(ChainInRedirect)})
		}
	}
}

func (b *builder) ownerGroups() {
	g := b.s.OwnerGroups
	if len(g.Exclude) > 0 {
		for _, grp := range g.Exclude {
			b.add(TableNat, ChainOutputChain, Rule{Match: Match{Owners: []OwnerMatch{{Group: grp}}}, Verdict: ret})
		}
		return
	}
	if len(g.Include) > 0 {
		var none []OwnerMatch
		for _, grp := range g.Include {
			none = append(none, OwnerMatch{Group: grp, Neg: true})
		}
		b.add(TableNat, ChainOutputChain, Rule{Match: Match{Owners: none}, Verdict: ret, Comment: "only the listed groups are captured"})
	}
}

func (b *builder) dns() {
	s := b.s
	zone := func(z uint16) Verdict { return Verdict{Kind: CTZone, Zone: z} }
	redirect := Verdict{Kind: Redirect, Port: s.DNSPort}
	dst := func(a netip.Addr) PrefixMatch { return PrefixMatch{Prefix: netip.PrefixFrom(a, a.BitLen())} }
	fam := func(a netip.Addr) Family {
		if a.Is4() {
			return V4
		}
		return V6
	}
	servers := append(append([]netip.Addr(nil), s.DNSServersV4...), s.DNSServersV6...)
	dnsMatch := func(p Proto) Match { return Match{Proto: p, DPorts: PortMatch{Ports: dnsPort}} }

	b.add(TableRaw, ChainOutput, Rule{Verdict: jump(ChainOutputDNS)})
	b.add(TableNat, ChainOutputChain, Rule{Verdict: jump(ChainOutputDNS), IfTargetNonEmpty: true})
	for _, p := range []Proto{TCP, UDP} {
		if s.CaptureAllDNS {
			b.add(TableNat, ChainOutputDNS, Rule{Match: dnsMatch(p), Verdict: redirect})
			continue
		}
		for _, a := range servers {
			m := dnsMatch(p)
			m.Dst = dst(a)
			b.add(TableNat, ChainOutputDNS, Rule{Family: fam(a), Match: m, Verdict: redirect})
		}
	}
	// Conntrack zones keep the proxy's upstream DNS flows (zone 1) apart from the
	// app's flows to the proxy (zone 2), avoiding UDP conntrack races.
	for _, own := range proxyOwners(s) {
		b.add(TableRaw, ChainOutputDNS, Rule{Match: Match{Proto: UDP, DPorts: PortMatch{Ports: dnsPort}, Owners: own}, Verdict: zone(1)})
		b.add(TableRaw, ChainOutputDNS, Rule{Match: Match{Proto: UDP, SPorts: PortMatch{Ports: []uint16{s.DNSPort}}, Owners: own}, Verdict: zone(2)})
	}
	b.add(TableRaw, ChainPrerouting, Rule{Verdict: jump(ChainInbound), IfTargetNonEmpty: true})
	if s.CaptureAllDNS {
		b.add(TableRaw, ChainOutputDNS, Rule{Match: Match{Proto: UDP, DPorts: PortMatch{Ports: dnsPort}}, Verdict: zone(2)})
		b.add(TableRaw, ChainInbound, Rule{Match: Match{Proto: UDP, SPorts: PortMatch{Ports: dnsPort}}, Verdict: zone(1)})
		return
	}
	for _, a := range servers {
		b.add(TableRaw, ChainOutputDNS, Rule{Family: fam(a), Match: Match{Proto: UDP, DPorts: PortMatch{Ports: dnsPort}, Dst: dst(a)}, Verdict: zone(2)})
		b.add(TableRaw, ChainInbound, Rule{Family: fam(a), Match: Match{Proto: UDP, SPorts: PortMatch{Ports: dnsPort}, Src: dst(a)}, Verdict: zone(1)})
	}
}

func (b *builder) outboundInclude() {
	s := b.s
	if s.OutboundIPRanges.All {
		b.add(TableNat, ChainOutputChain, Rule{Verdict: jump(ChainRedirect)})
		for _, ifc := range s.RerouteInterfaces {
			b.insert(TableNat, ChainPrerouting, 1, Rule{Match: Match{In: IfaceMatch{Name: ifc}}, Verdict: jump(ChainRedirect)})
		}
		return
	}
	for _, prefixes := range [][]netip.Prefix{s.OutboundIPRanges.V4(), s.OutboundIPRanges.V6()} {
		for _, p := range prefixes {
			for _, ifc := range s.RerouteInterfaces {
				b.insert(TableNat, ChainPrerouting, 1, Rule{Family: family(p), Match: Match{In: IfaceMatch{Name: ifc}, Dst: PrefixMatch{Prefix: p}}, Verdict: jump(ChainRedirect)})
			}
			b.add(TableNat, ChainOutputChain, Rule{Family: family(p), Match: Match{Dst: PrefixMatch{Prefix: p}}, Verdict: jump(ChainRedirect)})
		}
	}
}

func (b *builder) tproxyMarks() {
	s := b.s
	mark := s.TProxyMark
	lo := IfaceMatch{Name: "lo"}
	b.add(TableMangle, ChainPrerouting, Rule{Match: Match{Proto: TCP, Mark: &MarkMatch{Value: mark}}, Verdict: Verdict{Kind: SaveMark},
		Comment: "keep the mark set by the proxy's original_src filter on the connection"})
	b.add(TableMangle, ChainOutput, Rule{Match: Match{Proto: TCP, Out: lo, Mark: &MarkMatch{Value: mark}}, Verdict: ret})
	owners := proxyOwners(s)
	for _, own := range owners {
		b.addVersioned(TableMangle, ChainOutput, s.HostLoopback, v6Loopback, setDst(true),
			Rule{Match: Match{Proto: TCP, Out: lo, Owners: own}, Verdict: Verdict{Kind: SetMark, Mark: spec.OutboundMark}})
	}
	b.add(TableMangle, ChainOutput, Rule{Match: Match{Proto: TCP, ConnMark: &MarkMatch{Value: mark}}, Verdict: Verdict{Kind: RestoreMark}})
	b.insert(TableMangle, ChainInbound, 1, Rule{Match: Match{Proto: TCP, Mark: &MarkMatch{Value: mark}}, Verdict: ret})
	b.insert(TableMangle, ChainInbound, 2, Rule{Family: V4, Match: Match{Proto: TCP, In: lo, Src: PrefixMatch{Prefix: v4Passthru}}, Verdict: ret})
	b.insert(TableMangle, ChainInbound, 2, Rule{Family: V6, Match: Match{Proto: TCP, In: lo, Src: PrefixMatch{Prefix: v6Passthru}}, Verdict: ret})
	b.insert(TableMangle, ChainInbound, 3, Rule{Match: Match{Proto: TCP, In: lo, Mark: &MarkMatch{Value: spec.OutboundMark, Neg: true}}, Verdict: ret})
}
