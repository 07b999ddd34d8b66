// Package rules turns a redirect spec into the desired ruleset, in a model that no
// backend owns: tables, chains and typed rules (matches plus one verdict). Renderers
// (pkg/rules/ipt, pkg/rules/nft) and the native nftables backend translate the
// model; nothing here has effects.
//
// The model keeps Istio's table and chain names (nat, mangle, raw; ISTIO_INBOUND,
// ISTIO_OUTPUT, ...) and its generation order. Because Istio's iptables generator
// writes IPv4 and IPv6 separately while its nftables generator writes one inet
// table for both, a table holds the ordered list of operations (append, insert at
// a position) and Resolve computes the final chains for one view: IPv4, IPv6 or inet.
package rules

import (
	"net/netip"
)

// Family is a set of IP families a rule applies to.
type Family uint8

const (
	V4   Family = 1 << iota // IPv4 only
	V6                      // IPv6 only
	Both = V4 | V6
)

// Has reports whether f includes all of g.
func (f Family) Has(g Family) bool { return f&g == g }

func (f Family) String() string {
	switch f {
	case V4:
		return "ipv4"
	case V6:
		return "ipv6"
	case Both:
		return "inet"
	}
	return "none"
}

// Table names (iptables) and their nftables equivalents.
const (
	TableNat    = "nat"
	TableMangle = "mangle"
	TableRaw    = "raw"
)

// Chain names, as Istio names them. Lowercased with '_' → '-' for nftables.
const (
	ChainPrerouting  = "PREROUTING"
	ChainOutput      = "OUTPUT"
	ChainInbound     = "ISTIO_INBOUND"
	ChainRedirect    = "ISTIO_REDIRECT"
	ChainInRedirect  = "ISTIO_IN_REDIRECT"
	ChainOutputChain = "ISTIO_OUTPUT"
	ChainOutputDNS   = "ISTIO_OUTPUT_DNS"
	ChainDivert      = "ISTIO_DIVERT"
	ChainTProxy      = "ISTIO_TPROXY"
	ChainDrop        = "ISTIO_DROP"
	// meshcni's own chains (IPv6 mode drop), named like Istio's so that whatever
	// recognises the redirect's ISTIO_* chains recognises them too.
	ChainIPv6DropIn  = "ISTIO_IPV6_DROP_IN"
	ChainIPv6DropOut = "ISTIO_IPV6_DROP_OUT"
)

// IsBuiltin reports whether a chain is a kernel hook chain (PREROUTING, OUTPUT).
func IsBuiltin(chain string) bool { return chain == ChainPrerouting || chain == ChainOutput }

// Proto is a layer-4 protocol match.
type Proto uint8

const (
	AnyProto Proto = iota
	TCP
	UDP
	ICMPv6
)

func (p Proto) String() string {
	switch p {
	case TCP:
		return "tcp"
	case UDP:
		return "udp"
	case ICMPv6:
		return "ipv6-icmp"
	}
	return ""
}

// IfaceMatch matches an input or output interface by name (Name == "" means no match).
type IfaceMatch struct {
	Name string
	Neg  bool
}

// PrefixMatch matches a source or destination prefix (invalid Prefix means no match).
// A rule with a prefix match applies to the prefix's family only.
type PrefixMatch struct {
	Prefix netip.Prefix
	Neg    bool
}

// PortMatch matches one or several ports (none: no match).
type PortMatch struct {
	Ports []uint16
	Neg   bool
}

// OwnerMatch matches the socket owner's UID or GID. Group may be a name (resolved by
// the tool that loads it) or a decimal GID.
type OwnerMatch struct {
	UID   *uint32
	Group string
	Neg   bool
}

// MarkMatch matches the packet mark or the connection mark.
type MarkMatch struct {
	Value uint32
	Neg   bool
}

// CTState is a conntrack state set.
type CTState uint8

const (
	CTInvalid CTState = 1 << iota
	CTEstablished
	CTRelated
)

// Names lists the states in the order both iptables and nft print them.
func (s CTState) Names() []string {
	var out []string
	if s&CTInvalid != 0 {
		out = append(out, "invalid")
	}
	if s&CTRelated != 0 {
		out = append(out, "related")
	}
	if s&CTEstablished != 0 {
		out = append(out, "established")
	}
	return out
}

// Match is the conjunction of a rule's conditions. Zero fields match everything.
type Match struct {
	// NFProto matches the packet's family (V4 or V6; 0: either). Only the inet view
	// needs it written: an iptables view holds one family.
	NFProto  Family
	Proto    Proto
	In, Out  IfaceMatch
	Src, Dst PrefixMatch
	DPorts   PortMatch
	SPorts   PortMatch
	Owners   []OwnerMatch // all must hold
	Mark     *MarkMatch
	ConnMark *MarkMatch
	CTState  CTState
}

// VerdictKind is what a rule does with a matching packet.
type VerdictKind uint8

const (
	Jump        VerdictKind = iota + 1 // continue in Chain
	Return                             // back to the calling chain
	Accept                             // stop, accept
	Drop                               // stop, drop
	Redirect                           // NAT to Port on the local host
	TProxy                             // mangle: deliver to Port via TPROXY, set Mark, accept
	SetMark                            // set the packet mark to Mark, continue
	SaveMark                           // connection mark := packet mark
	RestoreMark                        // packet mark := connection mark
	CTZone                             // conntrack zone := Zone
)

// Verdict is a rule's single action.
type Verdict struct {
	Kind  VerdictKind
	Chain string // Jump
	Port  uint16 // Redirect, TProxy
	Mark  uint32 // TProxy, SetMark
	Zone  uint16 // CTZone
}

// Scope limits a rule to the iptables views (IPv4, IPv6) or to the inet view, where
// Istio's two generators write different rules for the same purpose. Zero: every view.
type Scope uint8

const (
	AllViews      Scope = iota
	IptablesViews       // Resolve(V4) and Resolve(V6) only
	InetView            // Resolve(Both) only
)

// in reports whether a rule of this scope belongs to the inet view (inet) or to an
// iptables view (!inet).
func (s Scope) in(inet bool) bool {
	switch s {
	case IptablesViews:
		return !inet
	case InetView:
		return inet
	}
	return true
}

// Rule is one typed rule.
type Rule struct {
	Family  Family
	Scope   Scope
	Match   Match
	Verdict Verdict
	// IfTargetNonEmpty drops a Jump from a view in which its target chain holds no
	// rule (Istio creates DNS jumps per family only where they lead somewhere).
	IfTargetNonEmpty bool
	// Uncaptured marks meshcni's rules for a family whose capture rules are not
	// written (not in Ruleset.Families): they pass or drop that family's traffic,
	// and stay in the views of their Family regardless of Ruleset.Families.
	Uncaptured bool
	// Comment says why the rule exists (not rendered into the kernel).
	Comment string
}

// Op is one generation step: append a rule to a chain, or insert it at a 1-based
// position (iptables -I semantics; past the end means append).
type Op struct {
	Chain  string
	Insert bool
	Pos    int
	Rule   Rule
}

// Table is a table's ordered operations.
type Table struct {
	Name string
	Ops  []Op
}

// PolicyRoute is the TPROXY policy routing: packets with Mark are looked up in
// Table, which routes everything to the local host over lo.
type PolicyRoute struct {
	Mark  uint32
	Table uint32
}

// Ruleset is the whole desired state of one pod's redirect.
type Ruleset struct {
	Families Family // families whose capture rules are written
	Tables   []*Table
	Route    *PolicyRoute // nil unless TPROXY
	// IPv6Loopback asks for ::6/128 on lo (the IPv6 inbound passthrough source).
	IPv6Loopback bool
}

// Table returns the named table, or nil.
func (rs *Ruleset) Table(name string) *Table {
	for _, t := range rs.Tables {
		if t.Name == name {
			return t
		}
	}
	return nil
}

// Chain is a resolved chain: its final rules in order for one view.
type Chain struct {
	Name  string
	Rules []Rule
}

// ResolvedTable is a table's chains for one view, in order of first use.
type ResolvedTable struct {
	Name   string
	Chains []Chain
}

// Chain returns the named chain of a resolved table, or nil.
func (t *ResolvedTable) Chain(name string) *Chain {
	for i := range t.Chains {
		if t.Chains[i].Name == name {
			return &t.Chains[i]
		}
	}
	return nil
}

// Resolve plays the operations of every table for one view (V4, V6, or Both for an
// inet table) and returns the non-empty tables with their non-empty chains. A
// family's capture rules are in a view only when the family is in Families; its
// Uncaptured rules only when it is not.
func (rs *Ruleset) Resolve(view Family) []ResolvedTable {
	var out []ResolvedTable
	for _, t := range rs.Tables {
		rt := resolveTable(t, view, rs.Families, view == Both)
		if len(rt.Chains) > 0 {
			out = append(out, rt)
		}
	}
	return out
}

// inView reports whether a rule belongs to a view, given the captured families.
func (r *Rule) inView(view, captured Family, inet bool) bool {
	if !r.Scope.in(inet) {
		return false
	}
	if r.Uncaptured {
		return r.Family&view&^captured != 0
	}
	return r.Family&view&captured != 0
}

func resolveTable(t *Table, view, captured Family, inet bool) ResolvedTable {
	var order []string
	chains := map[string][]Rule{}
	for _, op := range t.Ops {
		if !op.Rule.inView(view, captured, inet) {
			continue
		}
		rules, seen := chains[op.Chain]
		if !seen {
			order = append(order, op.Chain)
		}
		if op.Insert && op.Pos-1 < len(rules) {
			i := max(op.Pos-1, 0)
			rules = append(rules[:i], append([]Rule{op.Rule}, rules[i:]...)...)
		} else {
			rules = append(rules, op.Rule)
		}
		chains[op.Chain] = rules
	}
	// Drop conditional jumps whose target is empty in this view.
	for name, rules := range chains {
		kept := rules[:0:0]
		for _, r := range rules {
			if r.IfTargetNonEmpty && r.Verdict.Kind == Jump && len(chains[r.Verdict.Chain]) == 0 {
				continue
			}
			kept = append(kept, r)
		}
		chains[name] = kept
	}
	rt := ResolvedTable{Name: t.Name}
	for _, name := range order {
		if len(chains[name]) > 0 {
			rt.Chains = append(rt.Chains, Chain{Name: name, Rules: chains[name]})
		}
	}
	return rt
}
