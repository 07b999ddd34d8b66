package rules

import (
	"fmt"
	"net/netip"
	"reflect"
	"strings"
	"testing"

	"github.com/meshcni/meshcni/pkg/spec"
)

// The fixed prefixes are built from bytes: they must be the parsed ones.
func TestFixedPrefixes(t *testing.T) {
	for _, tc := range []struct {
		got  netip.Prefix
		want string
	}{
		{v6Loopback, "::1/128"},
		{v4Passthru, "127.0.0.6/32"},
		{v6Passthru, "::6/128"},
	} {
		if want := netip.MustParsePrefix(tc.want); tc.got != want {
			t.Errorf("%v (%#v), want %v (%#v)", tc.got, tc.got, want, want)
		}
	}
}

// The model for representative specs: specific rules present (at a position when
// order matters) or absent, written as literal model values.

// expectRule is one expectation on a resolved chain: the rule (Match and Verdict; its
// Family, Scope and Comment are not compared) is present at Pos (1-based; 0: anywhere;
// -1: last), or absent.
type expectRule struct {
	table, chain string
	rule         Rule
	pos          int
	absent       bool
}

func u32(n uint32) *uint32 { return &n }

func pfx(s string) PrefixMatch     { return PrefixMatch{Prefix: netip.MustParsePrefix(s)} }
func notPfx(s string) PrefixMatch  { return PrefixMatch{Prefix: netip.MustParsePrefix(s), Neg: true} }
func ports(ps ...uint16) PortMatch { return PortMatch{Ports: ps} }
func toChain(c string) Verdict     { return Verdict{Kind: Jump, Chain: c} }
func redirectTo(p uint16) Verdict  { return Verdict{Kind: Redirect, Port: p} }
func uidIs(n uint32) []OwnerMatch  { return []OwnerMatch{{UID: u32(n)}} }
func gidIs(g string) []OwnerMatch  { return []OwnerMatch{{Group: g}} }

var (
	returns = Verdict{Kind: Return}
	lo      = IfaceMatch{Name: "lo"}
)

func sameRule(a, b Rule) bool {
	return reflect.DeepEqual(a.Match, b.Match) && reflect.DeepEqual(a.Verdict, b.Verdict)
}

// resolvedChain returns a chain's rules in one view (nil when the chain or table is absent).
func resolvedChain(rs *Ruleset, view Family, table, chain string) []Rule {
	for _, t := range rs.Resolve(view) {
		if t.Name == table {
			if c := t.Chain(chain); c != nil {
				return c.Rules
			}
		}
	}
	return nil
}

func checkRules(t *testing.T, rs *Ruleset, view Family, want []expectRule) {
	t.Helper()
	for _, w := range want {
		rules := resolvedChain(rs, view, w.table, w.chain)
		at := -1
		for i, r := range rules {
			if sameRule(r, w.rule) {
				at = i
				break
			}
		}
		switch {
		case w.absent && at >= 0:
			t.Errorf("%s %s %s: rule %+v is there (position %d), want it absent", view, w.table, w.chain, w.rule, at+1)
		case w.absent:
		case at < 0:
			t.Errorf("%s %s %s: missing rule %+v; the chain holds:\n%s", view, w.table, w.chain, w.rule, dump(rules))
		case w.pos > 0 && at != w.pos-1, w.pos == -1 && at != len(rules)-1:
			t.Errorf("%s %s %s: rule %+v at position %d of %d, want %d (-1: last); the chain holds:\n%s",
				view, w.table, w.chain, w.rule, at+1, len(rules), w.pos, dump(rules))
		}
	}
}

func dump(rules []Rule) string {
	var sb strings.Builder
	for i, r := range rules {
		fmt.Fprintf(&sb, "  %d. %+v → %+v\n", i+1, r.Match, r.Verdict)
	}
	return sb.String()
}

// tableNames lists the non-empty tables of a view.
func tableNames(rs *Ruleset, view Family) []string {
	var out []string
	for _, t := range rs.Resolve(view) {
		out = append(out, t.Name)
	}
	return out
}

func podSpec(edit func(s *spec.Spec)) *spec.Spec {
	s := spec.PodDefaults()
	edit(&s)
	if err := s.Validate(); err != nil {
		panic(err)
	}
	return &s
}

func TestBuildRedirect(t *testing.T) {
	rs := Build(podSpec(func(*spec.Spec) {}))
	if got := tableNames(rs, V4); !reflect.DeepEqual(got, []string{"nat"}) {
		t.Errorf("IPv4 tables %q, want only nat", got)
	}
	if got := rs.Resolve(V6); got != nil {
		t.Errorf("IPv6 is disabled, yet its view holds %+v", got)
	}
	if rs.Route != nil || rs.IPv6Loopback {
		t.Errorf("Route %+v, IPv6Loopback %v; want none for REDIRECT over IPv4", rs.Route, rs.IPv6Loopback)
	}
	checkRules(t, rs, V4, []expectRule{
		{table: "nat", chain: "PREROUTING", rule: Rule{Match: Match{Proto: TCP}, Verdict: toChain("ISTIO_INBOUND")}, pos: 1},
		{table: "nat", chain: "ISTIO_INBOUND", rule: Rule{Match: Match{Proto: TCP, DPorts: ports(15008)}, Verdict: returns}, pos: 1},
		{table: "nat", chain: "ISTIO_INBOUND", rule: Rule{Match: Match{Proto: TCP, DPorts: ports(15020)}, Verdict: returns}, pos: 2},
		{table: "nat", chain: "ISTIO_INBOUND", rule: Rule{Match: Match{Proto: TCP, DPorts: ports(15021)}, Verdict: returns}, pos: 3},
		{table: "nat", chain: "ISTIO_INBOUND", rule: Rule{Match: Match{Proto: TCP, DPorts: ports(15090)}, Verdict: returns}, pos: 4},
		{table: "nat", chain: "ISTIO_INBOUND", rule: Rule{Match: Match{Proto: TCP}, Verdict: toChain("ISTIO_IN_REDIRECT")}, pos: -1},
		{table: "nat", chain: "ISTIO_REDIRECT", rule: Rule{Match: Match{Proto: TCP}, Verdict: redirectTo(15001)}, pos: 1},
		{table: "nat", chain: "ISTIO_IN_REDIRECT", rule: Rule{Match: Match{Proto: TCP}, Verdict: redirectTo(15006)}, pos: 1},
		{table: "nat", chain: "OUTPUT", rule: Rule{Verdict: toChain("ISTIO_OUTPUT")}, pos: 1},
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Match: Match{Out: lo, Src: pfx("127.0.0.6/32")}, Verdict: returns}, pos: 1},
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Match: Match{Proto: TCP, Out: lo, Dst: notPfx("127.0.0.1/32"),
			DPorts: PortMatch{Ports: []uint16{15008}, Neg: true}, Owners: uidIs(1337)}, Verdict: toChain("ISTIO_IN_REDIRECT")}, pos: 2},
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Match: Match{Out: lo, Owners: []OwnerMatch{{UID: u32(1337), Neg: true}}}, Verdict: returns}, pos: 3},
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Match: Match{Owners: uidIs(1337)}, Verdict: returns}, pos: 4},
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Match: Match{Owners: gidIs("1337")}, Verdict: returns}, pos: 7},
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Match: Match{Dst: pfx("127.0.0.1/32")}, Verdict: returns}, pos: 8},
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Verdict: toChain("ISTIO_REDIRECT")}, pos: -1},
		{table: "nat", chain: "ISTIO_OUTPUT_DNS", rule: Rule{Match: Match{Proto: UDP, DPorts: ports(53)}, Verdict: redirectTo(15053)}, absent: true},
	})
}

// TestBuildTProxyNoInbound: TPROXY with no inbound port captured needs no policy
// routing, and Istio adds none (its marks stay: they are part of its golden rules).
func TestBuildTProxyNoInbound(t *testing.T) {
	rs := Build(podSpec(func(s *spec.Spec) {
		s.Mode = spec.ModeTProxy
		s.InboundPorts = spec.PortSet{}
	}))
	if rs.Route != nil {
		t.Errorf("Route = %+v, want none: nothing inbound is captured", rs.Route)
	}
	if got := tableNames(rs, V4); !reflect.DeepEqual(got, []string{"nat", "mangle"}) {
		t.Errorf("IPv4 tables %q, want nat and mangle (the TPROXY marks)", got)
	}
}

func TestBuildTProxy(t *testing.T) {
	rs := Build(podSpec(func(s *spec.Spec) { s.Mode = spec.ModeTProxy }))
	if rs.Route == nil || *rs.Route != (PolicyRoute{Mark: 1337, Table: 133}) {
		t.Errorf("Route = %+v, want mark 1337 → table 133", rs.Route)
	}
	if got := tableNames(rs, V4); !reflect.DeepEqual(got, []string{"nat", "mangle"}) {
		t.Errorf("IPv4 tables %q, want nat and mangle", got)
	}
	established := Match{Proto: TCP, CTState: CTRelated | CTEstablished}
	checkRules(t, rs, V4, []expectRule{
		{table: "mangle", chain: "PREROUTING", rule: Rule{Match: Match{Proto: TCP}, Verdict: toChain("ISTIO_INBOUND")}, pos: 1},
		{table: "mangle", chain: "PREROUTING", rule: Rule{Match: Match{Proto: TCP, Mark: &MarkMatch{Value: 1337}}, Verdict: Verdict{Kind: SaveMark}}, pos: 2},
		{table: "mangle", chain: "ISTIO_DIVERT", rule: Rule{Verdict: Verdict{Kind: SetMark, Mark: 1337}}, pos: 1},
		{table: "mangle", chain: "ISTIO_DIVERT", rule: Rule{Verdict: Verdict{Kind: Accept}}, pos: 2},
		{table: "mangle", chain: "ISTIO_TPROXY", rule: Rule{Match: Match{Proto: TCP, Dst: notPfx("127.0.0.1/32")}, Verdict: Verdict{Kind: TProxy, Port: 15006, Mark: 1337}}, pos: 1},
		{table: "mangle", chain: "ISTIO_INBOUND", rule: Rule{Match: Match{Proto: TCP, Mark: &MarkMatch{Value: 1337}}, Verdict: returns}, pos: 1},
		{table: "mangle", chain: "ISTIO_INBOUND", rule: Rule{Match: Match{Proto: TCP, In: lo, Src: pfx("127.0.0.6/32")}, Verdict: returns}, pos: 2},
		{table: "mangle", chain: "ISTIO_INBOUND", rule: Rule{Match: Match{Proto: TCP, In: lo, Mark: &MarkMatch{Value: 1338, Neg: true}}, Verdict: returns}, pos: 3},
		{table: "mangle", chain: "ISTIO_INBOUND", rule: Rule{Match: Match{Proto: TCP, DPorts: ports(15020)}, Verdict: returns}},
		{table: "mangle", chain: "ISTIO_INBOUND", rule: Rule{Match: established, Verdict: toChain("ISTIO_DIVERT")}, pos: 7},
		{table: "mangle", chain: "ISTIO_INBOUND", rule: Rule{Match: Match{Proto: TCP}, Verdict: toChain("ISTIO_TPROXY")}, pos: -1},
		{table: "mangle", chain: "OUTPUT", rule: Rule{Match: Match{Proto: TCP, Out: lo, Dst: notPfx("127.0.0.1/32"), Owners: uidIs(1337)}, Verdict: Verdict{Kind: SetMark, Mark: 1338}}},
		{table: "mangle", chain: "OUTPUT", rule: Rule{Match: Match{Proto: TCP, ConnMark: &MarkMatch{Value: 1337}}, Verdict: Verdict{Kind: RestoreMark}}, pos: -1},
		// Inbound is captured in mangle, not nat.
		{table: "nat", chain: "PREROUTING", rule: Rule{Match: Match{Proto: TCP}, Verdict: toChain("ISTIO_INBOUND")}, absent: true},
		{table: "nat", chain: "ISTIO_INBOUND", rule: Rule{Match: Match{Proto: TCP}, Verdict: toChain("ISTIO_IN_REDIRECT")}, absent: true},
		// Outbound still goes through nat REDIRECT.
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Verdict: toChain("ISTIO_REDIRECT")}, pos: -1},
	})
}

func TestBuildDNS(t *testing.T) {
	all := Build(podSpec(func(s *spec.Spec) { s.RedirectDNS, s.CaptureAllDNS = true, true }))
	checkRules(t, all, V4, []expectRule{
		{table: "nat", chain: "ISTIO_OUTPUT_DNS", rule: Rule{Match: Match{Proto: TCP, DPorts: ports(53)}, Verdict: redirectTo(15053)}, pos: 1},
		{table: "nat", chain: "ISTIO_OUTPUT_DNS", rule: Rule{Match: Match{Proto: UDP, DPorts: ports(53)}, Verdict: redirectTo(15053)}, pos: 2},
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Verdict: toChain("ISTIO_OUTPUT_DNS")}},
		// The proxy's lo traffic to port 53 is not sent back inbound; the app's is not exempt.
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Match: Match{Proto: TCP, Out: lo, Dst: notPfx("127.0.0.1/32"),
			DPorts: PortMatch{Ports: []uint16{53, 15008}, Neg: true}, Owners: uidIs(1337)}, Verdict: toChain("ISTIO_IN_REDIRECT")}},
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Match: Match{Proto: TCP, Out: lo, DPorts: PortMatch{Ports: []uint16{53}, Neg: true},
			Owners: []OwnerMatch{{UID: u32(1337), Neg: true}}}, Verdict: returns}},
		{table: "raw", chain: "OUTPUT", rule: Rule{Verdict: toChain("ISTIO_OUTPUT_DNS")}, pos: 1},
		{table: "raw", chain: "ISTIO_OUTPUT_DNS", rule: Rule{Match: Match{Proto: UDP, DPorts: ports(53), Owners: uidIs(1337)}, Verdict: Verdict{Kind: CTZone, Zone: 1}}, pos: 1},
		{table: "raw", chain: "ISTIO_OUTPUT_DNS", rule: Rule{Match: Match{Proto: UDP, SPorts: ports(15053), Owners: uidIs(1337)}, Verdict: Verdict{Kind: CTZone, Zone: 2}}, pos: 2},
		{table: "raw", chain: "ISTIO_OUTPUT_DNS", rule: Rule{Match: Match{Proto: UDP, DPorts: ports(53)}, Verdict: Verdict{Kind: CTZone, Zone: 2}}, pos: -1},
		{table: "raw", chain: "PREROUTING", rule: Rule{Verdict: toChain("ISTIO_INBOUND")}, pos: 1},
		{table: "raw", chain: "ISTIO_INBOUND", rule: Rule{Match: Match{Proto: UDP, SPorts: ports(53)}, Verdict: Verdict{Kind: CTZone, Zone: 1}}, pos: 1},
	})

	servers := Build(podSpec(func(s *spec.Spec) {
		s.RedirectDNS, s.EnableIPv6 = true, true
		s.DNSServersV4 = []netip.Addr{netip.MustParseAddr("10.96.0.10")}
	}))
	checkRules(t, servers, V4, []expectRule{
		{table: "nat", chain: "ISTIO_OUTPUT_DNS", rule: Rule{Match: Match{Proto: TCP, DPorts: ports(53), Dst: pfx("10.96.0.10/32")}, Verdict: redirectTo(15053)}, pos: 1},
		{table: "nat", chain: "ISTIO_OUTPUT_DNS", rule: Rule{Match: Match{Proto: UDP, DPorts: ports(53), Dst: pfx("10.96.0.10/32")}, Verdict: redirectTo(15053)}, pos: 2},
		{table: "nat", chain: "ISTIO_OUTPUT_DNS", rule: Rule{Match: Match{Proto: UDP, DPorts: ports(53)}, Verdict: redirectTo(15053)}, absent: true},
		{table: "raw", chain: "ISTIO_INBOUND", rule: Rule{Match: Match{Proto: UDP, SPorts: ports(53), Src: pfx("10.96.0.10/32")}, Verdict: Verdict{Kind: CTZone, Zone: 1}}},
	})
	// No IPv6 server: the IPv6 view has no DNS redirect and no jump to an empty chain.
	checkRules(t, servers, V6, []expectRule{
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Verdict: toChain("ISTIO_OUTPUT_DNS")}, absent: true},
		{table: "nat", chain: "ISTIO_OUTPUT_DNS", rule: Rule{Match: Match{Proto: UDP, DPorts: ports(53), Dst: pfx("10.96.0.10/32")}, Verdict: redirectTo(15053)}, absent: true},
		{table: "raw", chain: "PREROUTING", rule: Rule{Verdict: toChain("ISTIO_INBOUND")}, absent: true},
	})

	// REDIRECT_DNS without servers and without capture-all renders nothing (as Istio).
	none := Build(podSpec(func(s *spec.Spec) { s.RedirectDNS = true }))
	if got := tableNames(none, V4); !reflect.DeepEqual(got, []string{"nat"}) {
		t.Errorf("DNS on without servers: tables %q, want only nat", got)
	}
	checkRules(t, none, V4, []expectRule{
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Verdict: toChain("ISTIO_OUTPUT_DNS")}, absent: true},
	})
}

func TestBuildIPv6(t *testing.T) {
	rs := Build(podSpec(func(s *spec.Spec) { s.EnableIPv6 = true }))
	if !rs.IPv6Loopback || rs.Families != Both {
		t.Errorf("Families %v, IPv6Loopback %v; want inet and ::6 on lo", rs.Families, rs.IPv6Loopback)
	}
	checkRules(t, rs, V6, []expectRule{
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Match: Match{Out: lo, Src: pfx("::6/128")}, Verdict: returns}, pos: 1},
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Match: Match{Proto: TCP, Out: lo, Dst: notPfx("::1/128"),
			DPorts: PortMatch{Ports: []uint16{15008}, Neg: true}, Owners: uidIs(1337)}, Verdict: toChain("ISTIO_IN_REDIRECT")}, pos: 2},
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Match: Match{Dst: pfx("::1/128")}, Verdict: returns}},
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Match: Match{Out: lo, Src: pfx("127.0.0.6/32")}, Verdict: returns}, absent: true},
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Match: Match{Dst: pfx("127.0.0.1/32")}, Verdict: returns}, absent: true},
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Verdict: toChain("ISTIO_REDIRECT")}, pos: -1},
	})
	checkRules(t, rs, V4, []expectRule{
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Match: Match{Dst: pfx("::1/128")}, Verdict: returns}, absent: true},
	})
	only6 := Build(podSpec(func(s *spec.Spec) { s.EnableIPv4, s.EnableIPv6 = false, true }))
	if got := only6.Resolve(V4); got != nil {
		t.Errorf("IPv4 disabled, yet its view holds %+v", got)
	}
}

func TestBuildPorts(t *testing.T) {
	rs := Build(podSpec(func(s *spec.Spec) {
		s.InboundPorts = spec.PortSet{Ports: []uint16{80, 8080}}
		s.OutboundPorts = []uint16{3306}
		s.OutboundPortsExclude = []uint16{9000}
	}))
	checkRules(t, rs, V4, []expectRule{
		{table: "nat", chain: "ISTIO_INBOUND", rule: Rule{Match: Match{Proto: TCP, DPorts: ports(15008)}, Verdict: returns}, pos: 1},
		{table: "nat", chain: "ISTIO_INBOUND", rule: Rule{Match: Match{Proto: TCP, DPorts: ports(80)}, Verdict: toChain("ISTIO_IN_REDIRECT")}, pos: 2},
		{table: "nat", chain: "ISTIO_INBOUND", rule: Rule{Match: Match{Proto: TCP, DPorts: ports(8080)}, Verdict: toChain("ISTIO_IN_REDIRECT")}, pos: 3},
		// With a port list, no catch-all and no exclusions (Istio applies -d to '*' only).
		{table: "nat", chain: "ISTIO_INBOUND", rule: Rule{Match: Match{Proto: TCP}, Verdict: toChain("ISTIO_IN_REDIRECT")}, absent: true},
		{table: "nat", chain: "ISTIO_INBOUND", rule: Rule{Match: Match{Proto: TCP, DPorts: ports(15020)}, Verdict: returns}, absent: true},
		// Outbound exclusions come first, for TCP and UDP; included ports before the catch-all.
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Match: Match{Proto: TCP, DPorts: ports(9000)}, Verdict: returns}, pos: 1},
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Match: Match{Proto: UDP, DPorts: ports(9000)}, Verdict: returns}, pos: 2},
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Match: Match{Proto: TCP, DPorts: ports(3306)}, Verdict: toChain("ISTIO_REDIRECT")}, pos: 11},
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Verdict: toChain("ISTIO_REDIRECT")}, pos: 12},
	})

	none := Build(podSpec(func(s *spec.Spec) { s.InboundPorts = spec.PortSet{} }))
	checkRules(t, none, V4, []expectRule{
		{table: "nat", chain: "PREROUTING", rule: Rule{Match: Match{Proto: TCP}, Verdict: toChain("ISTIO_INBOUND")}, absent: true},
	})
}

func TestBuildCIDRs(t *testing.T) {
	rs := Build(podSpec(func(s *spec.Spec) {
		s.EnableIPv6 = true
		s.OutboundIPRanges = spec.PrefixSet{Prefixes: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("fd00::/8")}}
		s.OutboundIPRangesExclude = []netip.Prefix{netip.MustParsePrefix("10.96.0.0/12")}
	}))
	checkRules(t, rs, V4, []expectRule{
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Match: Match{Dst: pfx("10.96.0.0/12")}, Verdict: returns}, pos: 9},
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Match: Match{Dst: pfx("10.0.0.0/8")}, Verdict: toChain("ISTIO_REDIRECT")}, pos: -1},
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Match: Match{Dst: pfx("fd00::/8")}, Verdict: toChain("ISTIO_REDIRECT")}, absent: true},
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Verdict: toChain("ISTIO_REDIRECT")}, absent: true},
	})
	checkRules(t, rs, V6, []expectRule{
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Match: Match{Dst: pfx("fd00::/8")}, Verdict: toChain("ISTIO_REDIRECT")}, pos: -1},
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Match: Match{Dst: pfx("10.96.0.0/12")}, Verdict: returns}, absent: true},
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Match: Match{Dst: pfx("10.0.0.0/8")}, Verdict: toChain("ISTIO_REDIRECT")}, absent: true},
	})
	// A loopback range in the include list: the app's own lo traffic is captured too.
	loop := Build(podSpec(func(s *spec.Spec) {
		s.OutboundIPRanges = spec.PrefixSet{Prefixes: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}}
	}))
	checkRules(t, loop, V4, []expectRule{
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Match: Match{Out: lo, Owners: []OwnerMatch{{UID: u32(1337), Neg: true}}}, Verdict: returns}, absent: true},
	})
}

func TestBuildInterfaces(t *testing.T) {
	rs := Build(podSpec(func(s *spec.Spec) {
		s.ExcludeInterfaces = []string{"eth1"}
		s.RerouteInterfaces = []string{"tun0"}
	}))
	checkRules(t, rs, V4, []expectRule{
		{table: "nat", chain: "PREROUTING", rule: Rule{Match: Match{In: IfaceMatch{Name: "tun0"}}, Verdict: toChain("ISTIO_REDIRECT")}, pos: 1},
		{table: "nat", chain: "PREROUTING", rule: Rule{Match: Match{In: IfaceMatch{Name: "tun0"}}, Verdict: returns}, pos: 2},
		{table: "nat", chain: "PREROUTING", rule: Rule{Match: Match{In: IfaceMatch{Name: "eth1"}}, Verdict: returns}, pos: 3},
		{table: "nat", chain: "PREROUTING", rule: Rule{Match: Match{Proto: TCP}, Verdict: toChain("ISTIO_INBOUND")}, pos: 4},
		{table: "nat", chain: "OUTPUT", rule: Rule{Match: Match{Out: IfaceMatch{Name: "eth1"}}, Verdict: returns}, pos: 1},
		{table: "nat", chain: "OUTPUT", rule: Rule{Verdict: toChain("ISTIO_OUTPUT")}, pos: 2},
		{table: "mangle", chain: "PREROUTING", rule: Rule{Match: Match{In: IfaceMatch{Name: "eth1"}}, Verdict: returns}, absent: true},
	})

	tp := Build(podSpec(func(s *spec.Spec) {
		s.Mode = spec.ModeTProxy
		s.ExcludeInterfaces = []string{"eth1"}
		s.RerouteInterfaces = []string{"tun0"}
		s.OutboundIPRanges = spec.PrefixSet{Prefixes: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}}
	}))
	checkRules(t, tp, V4, []expectRule{
		{table: "mangle", chain: "PREROUTING", rule: Rule{Match: Match{In: IfaceMatch{Name: "eth1"}}, Verdict: returns}, pos: 1},
		{table: "mangle", chain: "OUTPUT", rule: Rule{Match: Match{Out: IfaceMatch{Name: "eth1"}}, Verdict: returns}, pos: 1},
		{table: "nat", chain: "PREROUTING", rule: Rule{Match: Match{In: IfaceMatch{Name: "tun0"}, Dst: pfx("10.0.0.0/8")}, Verdict: toChain("ISTIO_REDIRECT")}, pos: 1},
		{table: "nat", chain: "PREROUTING", rule: Rule{Match: Match{In: IfaceMatch{Name: "tun0"}}, Verdict: toChain("ISTIO_REDIRECT")}, absent: true},
	})
}

func TestBuildOwners(t *testing.T) {
	rs := Build(podSpec(func(s *spec.Spec) {
		s.ProxyUIDs = []uint32{1337, 1500}
		s.ProxyGIDs = []uint32{2000}
		s.OwnerGroups.Exclude = []string{"nogroup", "3000"}
	}))
	checkRules(t, rs, V4, []expectRule{
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Match: Match{Owners: uidIs(1337)}, Verdict: returns}, pos: 4},
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Match: Match{Owners: uidIs(1500)}, Verdict: returns}, pos: 7},
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Match: Match{Owners: gidIs("2000")}, Verdict: returns}, pos: 10},
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Match: Match{Owners: gidIs("nogroup")}, Verdict: returns}, pos: 11},
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Match: Match{Owners: gidIs("3000")}, Verdict: returns}, pos: 12},
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Match: Match{Owners: gidIs("1337")}, Verdict: returns}, absent: true},
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Match: Match{Proto: TCP, Out: lo, Dst: notPfx("127.0.0.1/32"),
			DPorts: PortMatch{Ports: []uint16{15008}, Neg: true}, Owners: gidIs("2000")}, Verdict: toChain("ISTIO_IN_REDIRECT")}, pos: 8},
	})

	include := Build(podSpec(func(s *spec.Spec) { s.OwnerGroups.Include = []string{"java", "202"} }))
	checkRules(t, include, V4, []expectRule{
		{table: "nat", chain: "ISTIO_OUTPUT", rule: Rule{Match: Match{Owners: []OwnerMatch{{Group: "java", Neg: true}, {Group: "202", Neg: true}}}, Verdict: returns}, pos: 8},
	})
}

func TestBuildDropInvalid(t *testing.T) {
	rs := Build(podSpec(func(s *spec.Spec) { s.DropInvalid, s.EnableIPv6 = true, true }))
	for _, view := range []Family{V4, V6} {
		checkRules(t, rs, view, []expectRule{
			{table: "mangle", chain: "PREROUTING", rule: Rule{Match: Match{CTState: CTInvalid}, Verdict: toChain("ISTIO_DROP")}, pos: 1},
			{table: "mangle", chain: "PREROUTING", rule: Rule{Match: Match{Proto: TCP, CTState: CTInvalid}, Verdict: toChain("ISTIO_DROP")}, absent: true},
			{table: "mangle", chain: "ISTIO_DROP", rule: Rule{Verdict: Verdict{Kind: Drop}}, pos: 1},
		})
	}
	// Istio's nftables generator drops invalid TCP only.
	checkRules(t, rs, Both, []expectRule{
		{table: "mangle", chain: "PREROUTING", rule: Rule{Match: Match{Proto: TCP, CTState: CTInvalid}, Verdict: toChain("ISTIO_DROP")}, pos: 1},
		{table: "mangle", chain: "PREROUTING", rule: Rule{Match: Match{CTState: CTInvalid}, Verdict: toChain("ISTIO_DROP")}, absent: true},
	})
}

// TestIPv6Views: what each view holds for IPv6, per IPv6 mode, for a pod whose IPv6
// rules Istio writes (EnableIPv6) or not. The ip6tables view is empty when IPv6
// passes, holds only the drop chains when it is dropped, Istio's capture rules when
// captured; the inet view's base chains start with `meta nfproto ipv6 return` when
// IPv6 is not captured (after the jump to the drop chain with drop).
func TestIPv6Views(t *testing.T) {
	pass := Rule{Match: Match{NFProto: V6}, Verdict: ret}
	dropIn := Rule{Match: Match{NFProto: V6}, Verdict: jump(ChainIPv6DropIn)}
	for _, tc := range []struct {
		mode      spec.IPv6Mode
		enable    bool
		families  Family
		v6Chains  []string // mangle and nat chains of the ip6tables view, in order
		natFirst  *Rule    // first rule of the inet nat OUTPUT chain (nil: no guard)
		mangleIn  []Rule   // first rules of the inet mangle PREROUTING chain
		loopback6 bool
	}{
		{spec.IPv6Istio, false, V4, nil, &pass, nil, false},
		{spec.IPv6Istio, true, Both, []string{"nat:ISTIO_INBOUND", "nat:ISTIO_REDIRECT", "nat:ISTIO_IN_REDIRECT", "nat:PREROUTING", "nat:OUTPUT", "nat:ISTIO_OUTPUT"}, nil, nil, true},
		{spec.IPv6Capture, false, Both, []string{"nat:ISTIO_INBOUND", "nat:ISTIO_REDIRECT", "nat:ISTIO_IN_REDIRECT", "nat:PREROUTING", "nat:OUTPUT", "nat:ISTIO_OUTPUT"}, nil, nil, true},
		{spec.IPv6Drop, false, V4, []string{"mangle:PREROUTING", "mangle:OUTPUT", "mangle:ISTIO_IPV6_DROP_IN", "mangle:ISTIO_IPV6_DROP_OUT"}, &pass, []Rule{dropIn}, false},
		{spec.IPv6Drop, true, Both, []string{"nat:ISTIO_INBOUND", "nat:ISTIO_REDIRECT", "nat:ISTIO_IN_REDIRECT", "nat:PREROUTING", "nat:OUTPUT", "nat:ISTIO_OUTPUT"}, nil, nil, true},
	} {
		t.Run(fmt.Sprintf("%s/EnableIPv6=%v", tc.mode, tc.enable), func(t *testing.T) {
			s := spec.PodDefaults()
			s.IPv6, s.EnableIPv6 = tc.mode, tc.enable
			rs := Build(&s)
			if rs.Families != tc.families || rs.IPv6Loopback != tc.loopback6 {
				t.Errorf("Families %s IPv6Loopback %v, want %s %v", rs.Families, rs.IPv6Loopback, tc.families, tc.loopback6)
			}
			var chains []string
			for _, rt := range rs.Resolve(V6) {
				for _, c := range rt.Chains {
					chains = append(chains, rt.Name+":"+c.Name)
				}
			}
			if !reflect.DeepEqual(chains, tc.v6Chains) {
				t.Errorf("ip6tables view chains %v, want %v", chains, tc.v6Chains)
			}
			inet := map[string]*ResolvedTable{}
			for _, rt := range rs.Resolve(Both) {
				inet[rt.Name] = &rt
			}
			first := func(table, chain string, n int) []Rule {
				c := inet[table].Chain(chain)
				if c == nil || len(c.Rules) < n {
					t.Fatalf("inet %s %s: fewer than %d rules", table, chain, n)
				}
				out := make([]Rule, n)
				for i, r := range c.Rules[:n] {
					out[i] = Rule{Match: r.Match, Verdict: r.Verdict}
				}
				return out
			}
			natOut := first(TableNat, ChainOutput, 1)[0]
			if tc.natFirst == nil && natOut.Match.NFProto != 0 || tc.natFirst != nil && !reflect.DeepEqual(natOut, *tc.natFirst) {
				t.Errorf("inet nat OUTPUT starts with %+v, want %+v", natOut, tc.natFirst)
			}
			if tc.mangleIn != nil {
				if got := first(TableMangle, ChainPrerouting, len(tc.mangleIn)); !reflect.DeepEqual(got, tc.mangleIn) {
					t.Errorf("inet mangle PREROUTING starts with %+v, want %+v", got, tc.mangleIn)
				}
			} else if inet[TableMangle] != nil {
				t.Errorf("inet mangle table present: %+v", inet[TableMangle])
			}
		})
	}
}
