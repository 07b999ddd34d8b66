// Package nft renders the rules model as an `nft -f` script in the style of Istio's
// native nftables mode: one inet table per model table (istio-proxy-nat,
// istio-proxy-mangle, istio-proxy-raw), chain names lowercased with '_' → '-', and
// each rule's statements written in the order Istio's generator writes them, so that
// the script, loaded into a kernel, reads back equal to Istio's rules. It is pure.
//
// The statement list of a rule (Statements) is shared with the native nftables
// backend (pkg/backend/nftables), which turns the same statements into netlink
// expressions: both paths agree by construction.
package nft

import (
	"fmt"
	"net/netip"
	"strconv"
	"strings"

	"github.com/meshcni/meshcni/pkg/rules"
)

// Tables lists the model tables meshcni writes, in the order they are rendered.
var Tables = []string{rules.TableNat, rules.TableMangle, rules.TableRaw}

// TableName returns the nftables (inet) table name of a model table.
func TableName(model string) string { return "istio-proxy-" + model }

// ChainName returns the nftables chain name of a model chain (ISTIO_OUTPUT →
// istio-output).
func ChainName(model string) string {
	return strings.ReplaceAll(strings.ToLower(model), "_", "-")
}

// BaseChain describes a base (hooked) chain.
type BaseChain struct {
	Type     string // nat, filter, route
	Hook     string // prerouting, output
	Priority int
}

// Base returns the base chain definition of a model chain in a model table, or false
// for a regular chain.
func Base(table, chain string) (BaseChain, bool) {
	var hook string
	switch chain {
	case rules.ChainPrerouting:
		hook = "prerouting"
	case rules.ChainOutput:
		hook = "output"
	default:
		return BaseChain{}, false
	}
	switch table {
	case rules.TableNat:
		return BaseChain{Type: "nat", Hook: hook, Priority: -100}, true
	case rules.TableMangle:
		if hook == "output" {
			return BaseChain{Type: "route", Hook: hook, Priority: -150}, true
		}
		return BaseChain{Type: "filter", Hook: hook, Priority: -150}, true
	case rules.TableRaw:
		return BaseChain{Type: "filter", Hook: hook, Priority: -300}, true
	}
	return BaseChain{}, false
}

// chainOrder is the order in which Istio declares each table's chains (and so the
// order of `nft list`). Arrays and a switch, not a package-level map: the CNI plugin
// links this package, and a map literal is built at every plugin start.
func chainOrder(table string) []string {
	switch table {
	case rules.TableNat:
		return natChainOrder[:]
	case rules.TableMangle:
		return mangleChainOrder[:]
	case rules.TableRaw:
		return rawChainOrder[:]
	}
	return nil
}

var (
	natChainOrder    = [...]string{rules.ChainPrerouting, rules.ChainOutput, rules.ChainInbound, rules.ChainRedirect, rules.ChainInRedirect, rules.ChainOutputChain, rules.ChainOutputDNS}
	mangleChainOrder = [...]string{rules.ChainPrerouting, rules.ChainOutput, rules.ChainDivert, rules.ChainTProxy, rules.ChainInbound, rules.ChainDrop}
	rawChainOrder    = [...]string{rules.ChainPrerouting, rules.ChainOutput, rules.ChainInbound, rules.ChainOutputDNS}
)

// Table is one resolved inet table, with its chains in declaration order.
type Table struct {
	Model  string // nat, mangle, raw
	Name   string // istio-proxy-nat, ...
	Chains []rules.Chain
}

// Resolve returns the inet view of the ruleset: the non-empty tables in Tables order
// with their non-empty chains in Istio's declaration order (chains unknown to Istio
// follow, in order of first use).
func Resolve(rs *rules.Ruleset) []Table {
	var out []Table
	resolved := rs.Resolve(rules.Both)
	for _, name := range Tables {
		for _, rt := range resolved {
			if rt.Name != name {
				continue
			}
			t := Table{Model: name, Name: TableName(name)}
			done := map[string]bool{}
			for _, cn := range chainOrder(name) {
				if c := rt.Chain(cn); c != nil {
					t.Chains = append(t.Chains, *c)
					done[cn] = true
				}
			}
			for _, c := range rt.Chains {
				if !done[c.Name] {
					t.Chains = append(t.Chains, c)
				}
			}
			out = append(out, t)
		}
	}
	return out
}

// Render returns an `nft -f` script that replaces meshcni's three tables with the
// ruleset's inet view in one transaction. Every table is added (so that deleting it
// cannot fail), deleted (so that no stale chain or rule survives), and the needed
// ones are created again; tables the ruleset does not need stay deleted. Applying the
// script twice gives the same state as once.
func Render(rs *rules.Ruleset) string {
	var sb strings.Builder
	for _, name := range Tables {
		fmt.Fprintf(&sb, "add table inet %s\n", TableName(name))
		fmt.Fprintf(&sb, "delete table inet %s\n", TableName(name))
	}
	for _, t := range Resolve(rs) {
		fmt.Fprintf(&sb, "add table inet %s\n", t.Name)
		for _, c := range t.Chains {
			if b, ok := Base(t.Model, c.Name); ok {
				fmt.Fprintf(&sb, "add chain inet %s %s { type %s hook %s priority %d ; }\n", t.Name, ChainName(c.Name), b.Type, b.Hook, b.Priority)
			} else {
				fmt.Fprintf(&sb, "add chain inet %s %s\n", t.Name, ChainName(c.Name))
			}
		}
		for _, c := range t.Chains {
			for _, r := range c.Rules {
				fmt.Fprintf(&sb, "add rule inet %s %s %s\n", t.Name, ChainName(c.Name), RuleText(t.Model, c.Name, r))
			}
		}
	}
	return sb.String()
}

// RuleText renders one rule's statements as nft writes them.
func RuleText(table, chain string, r rules.Rule) string {
	stmts := Statements(table, chain, r)
	parts := make([]string, len(stmts))
	for i, s := range stmts {
		parts[i] = s.String()
	}
	return strings.Join(parts, " ")
}

// Kind is the kind of one nft statement.
type Kind uint8

// Statement kinds: matches first, then the counter and the actions.
const (
	IIFName     Kind = iota + 1 // iifname [!=] Name
	OIFName                     // oifname [!=] Name
	L4Proto                     // meta l4proto Proto
	CTState                     // ct state State
	SAddr                       // ip/ip6 saddr [!=] Prefix
	DAddr                       // ip/ip6 daddr [!=] Prefix
	SPort                       // tcp/udp sport [!=] Ports
	DPort                       // tcp/udp dport [!=] Ports
	SKUID                       // [meta] skuid [!=] Value
	SKGID                       // [meta] skgid [!=] Group
	Mark                        // mark [!=] Value
	CTMark                      // ct mark [!=] Value
	Counter                     // counter
	Jump                        // jump Name
	Return                      // return
	Accept                      // accept
	Drop                        // drop
	Redirect                    // redirect to :Value
	TProxy                      // tproxy ip|ip6 to :Value (Family; 0 = unspecified)
	SetMark                     // meta mark set Value
	SaveMark                    // ct mark set mark
	RestoreMark                 // meta mark set ct mark
	CTZone                      // ct zone set Value
	NFProto                     // meta nfproto ipv4|ipv6 (Family)
)

// Stmt is one nft statement of a rule.
type Stmt struct {
	Kind   Kind
	Neg    bool
	Name   string       // interface or chain (nft names)
	Proto  rules.Proto  // L4Proto, SPort, DPort
	Prefix netip.Prefix // SAddr, DAddr
	Ports  []uint16     // SPort, DPort
	Value  uint32       // skuid, mark, port, zone
	Group  string       // SKGID: a name or a decimal GID
	State  rules.CTState
	Family rules.Family // TProxy: V4, V6, or 0 (unspecified); NFProto: V4 or V6
	Meta   bool         // "meta skuid" rather than "skuid" (same expression)
}

// Statements returns a rule's statements in the order Istio's nftables generator
// writes them. The order matters: the kernel keeps expressions in order, and nft
// adds its implicit dependencies (meta nfproto, meta l4proto) right before the
// statement needing them, so the same matches in another order read back
// differently.
//
// Istio's order is: interfaces, an explicit `meta l4proto`, ct state, addresses,
// ports, socket owners, marks; in the raw table ports come before addresses and the
// owners are written `meta skuid`. The protocol is written explicitly except where
// Istio relies on the port match's implicit one: UDP port matches, the raw table,
// and in nat ISTIO_OUTPUT / ISTIO_OUTPUT_DNS the port rules without interface (the
// excluded/included outbound ports, the per-server DNS redirects).
func Statements(table, chain string, r rules.Rule) []Stmt {
	m := r.Match
	var out []Stmt
	add := func(s Stmt) { out = append(out, s) }
	raw := table == rules.TableRaw

	if m.NFProto == rules.V4 || m.NFProto == rules.V6 {
		add(Stmt{Kind: NFProto, Family: m.NFProto})
	}
	if m.In.Name != "" {
		add(Stmt{Kind: IIFName, Name: m.In.Name, Neg: m.In.Neg})
	}
	if m.Out.Name != "" {
		add(Stmt{Kind: OIFName, Name: m.Out.Name, Neg: m.Out.Neg})
	}
	if m.Proto != rules.AnyProto && explicitProto(table, chain, m) {
		add(Stmt{Kind: L4Proto, Proto: m.Proto})
	}
	if m.CTState != 0 {
		add(Stmt{Kind: CTState, State: m.CTState})
	}
	addrs := func() {
		if m.Src.Prefix.IsValid() {
			add(Stmt{Kind: SAddr, Prefix: m.Src.Prefix, Neg: m.Src.Neg})
		}
		if m.Dst.Prefix.IsValid() {
			add(Stmt{Kind: DAddr, Prefix: m.Dst.Prefix, Neg: m.Dst.Neg})
		}
	}
	ports := func() {
		if len(m.SPorts.Ports) > 0 {
			add(Stmt{Kind: SPort, Proto: m.Proto, Ports: m.SPorts.Ports, Neg: m.SPorts.Neg})
		}
		if len(m.DPorts.Ports) > 0 {
			add(Stmt{Kind: DPort, Proto: m.Proto, Ports: m.DPorts.Ports, Neg: m.DPorts.Neg})
		}
	}
	if raw {
		ports()
		addrs()
	} else {
		addrs()
		ports()
	}
	for _, o := range m.Owners {
		if o.UID != nil {
			add(Stmt{Kind: SKUID, Value: *o.UID, Neg: o.Neg, Meta: raw})
		} else {
			add(Stmt{Kind: SKGID, Group: o.Group, Neg: o.Neg, Meta: raw})
		}
	}
	if m.Mark != nil {
		add(Stmt{Kind: Mark, Value: m.Mark.Value, Neg: m.Mark.Neg})
	}
	if m.ConnMark != nil {
		add(Stmt{Kind: CTMark, Value: m.ConnMark.Value, Neg: m.ConnMark.Neg})
	}

	v := r.Verdict
	if v.Kind != rules.TProxy {
		add(Stmt{Kind: Counter}) // Istio counts before every verdict but tproxy's
	}
	switch v.Kind {
	case rules.Jump:
		add(Stmt{Kind: Jump, Name: ChainName(v.Chain)})
	case rules.Return:
		add(Stmt{Kind: Return})
	case rules.Accept:
		add(Stmt{Kind: Accept})
	case rules.Drop:
		add(Stmt{Kind: Drop})
	case rules.Redirect:
		add(Stmt{Kind: Redirect, Value: uint32(v.Port)})
	case rules.TProxy:
		// Istio: tproxy ip to :PORT meta mark set MARK counter accept
		add(Stmt{Kind: TProxy, Value: uint32(v.Port), Family: tproxyFamily(r)})
		add(Stmt{Kind: SetMark, Value: v.Mark})
		add(Stmt{Kind: Counter})
		add(Stmt{Kind: Accept})
	case rules.SetMark:
		add(Stmt{Kind: SetMark, Value: v.Mark})
	case rules.SaveMark:
		add(Stmt{Kind: SaveMark})
	case rules.RestoreMark:
		add(Stmt{Kind: RestoreMark})
	case rules.CTZone:
		add(Stmt{Kind: CTZone, Value: uint32(v.Zone)})
	default:
		panic(fmt.Sprintf("nft: unknown verdict kind %d", v.Kind))
	}
	return out
}

// explicitProto reports whether Istio writes `meta l4proto` for a rule with a
// protocol. Without a port match the protocol must be explicit.
func explicitProto(table, chain string, m rules.Match) bool {
	if len(m.SPorts.Ports) == 0 && len(m.DPorts.Ports) == 0 {
		return true
	}
	if table == rules.TableRaw || m.Proto == rules.UDP {
		return false
	}
	if table == rules.TableNat && m.In.Name == "" && m.Out.Name == "" {
		switch chain {
		case rules.ChainOutputChain:
			return false
		case rules.ChainOutputDNS:
			return !m.Dst.Prefix.IsValid()
		}
	}
	return true
}

// tproxyFamily is the family a TPROXY rule's address belongs to: its prefix's, else
// the rule's own when it has one family, else unspecified.
func tproxyFamily(r rules.Rule) rules.Family {
	for _, p := range []netip.Prefix{r.Match.Dst.Prefix, r.Match.Src.Prefix} {
		if p.IsValid() {
			if p.Addr().Is4() {
				return rules.V4
			}
			return rules.V6
		}
	}
	if r.Family == rules.V4 || r.Family == rules.V6 {
		return r.Family
	}
	return 0
}

// AddrKeyword is "ip" for an IPv4 prefix and "ip6" for an IPv6 one.
func AddrKeyword(p netip.Prefix) string {
	if p.Addr().Is4() {
		return "ip"
	}
	return "ip6"
}

func neg(b bool) string {
	if b {
		return "!= "
	}
	return ""
}

func u(n uint32) string { return strconv.FormatUint(uint64(n), 10) }

// CTStateText renders a conntrack state set as Istio writes it.
func CTStateText(s rules.CTState) string { return strings.Join(s.Names(), ",") }

// PortsText renders one port, or an anonymous set of ports.
func PortsText(ps []uint16) string {
	if len(ps) == 1 {
		return strconv.Itoa(int(ps[0]))
	}
	parts := make([]string, len(ps))
	for i, p := range ps {
		parts[i] = strconv.Itoa(int(p))
	}
	return "{ " + strings.Join(parts, ", ") + " }"
}

func (s Stmt) String() string {
	meta := ""
	if s.Meta {
		meta = "meta "
	}
	switch s.Kind {
	case IIFName:
		return "iifname " + neg(s.Neg) + s.Name
	case OIFName:
		return "oifname " + neg(s.Neg) + s.Name
	case L4Proto:
		return "meta l4proto " + s.Proto.String()
	case CTState:
		return "ct state " + CTStateText(s.State)
	case SAddr:
		return AddrKeyword(s.Prefix) + " saddr " + neg(s.Neg) + s.Prefix.String()
	case DAddr:
		return AddrKeyword(s.Prefix) + " daddr " + neg(s.Neg) + s.Prefix.String()
	case SPort:
		return s.Proto.String() + " sport " + neg(s.Neg) + PortsText(s.Ports)
	case DPort:
		return s.Proto.String() + " dport " + neg(s.Neg) + PortsText(s.Ports)
	case SKUID:
		return meta + "skuid " + neg(s.Neg) + u(s.Value)
	case SKGID:
		return meta + "skgid " + neg(s.Neg) + s.Group
	case Mark:
		return "mark " + neg(s.Neg) + u(s.Value)
	case CTMark:
		return "ct mark " + neg(s.Neg) + u(s.Value)
	case Counter:
		return "counter"
	case Jump:
		return "jump " + s.Name
	case Return:
		return "return"
	case Accept:
		return "accept"
	case Drop:
		return "drop"
	case Redirect:
		return "redirect to :" + u(s.Value)
	case TProxy:
		switch s.Family {
		case rules.V4:
			return "tproxy ip to :" + u(s.Value)
		case rules.V6:
			return "tproxy ip6 to :" + u(s.Value)
		}
		return "tproxy to :" + u(s.Value)
	case SetMark:
		return "meta mark set " + u(s.Value)
	case SaveMark:
		return "ct mark set mark"
	case RestoreMark:
		return "meta mark set ct mark"
	case CTZone:
		return "ct zone set " + u(s.Value)
	case NFProto:
		if s.Family == rules.V4 {
			return "meta nfproto ipv4"
		}
		return "meta nfproto ipv6"
	}
	return fmt.Sprintf("<unknown statement %d>", s.Kind)
}
