package nftables

import (
	"bytes"
	"context"
	"fmt"
	"net/netip"
	"sort"
	"strconv"
	"strings"

	gnft "github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/rules"
	"github.com/meshcni/meshcni/pkg/rules/nft"
)

// liveRule is a rule read from the kernel.
type liveRule struct {
	key  string // fingerprint (see fingerprint)
	text string // decompiled, nft-like
}

type liveChain struct {
	name  string
	def   string // base chain definition, "" for a regular chain
	rules []liveRule
}

type liveTable struct {
	name   string
	chains []liveChain
}

// readLive reads meshcni's tables, chains, rules and anonymous sets. Its tables
// are those of the inet chains listed (meshcni writes no table without chains; an
// empty one is found and replaced by Apply's table listing, not read back here).
func readLive(c *gnft.Conn) ([]liveTable, error) {
	chains, err := c.ListChainsOfTableFamily(gnft.TableFamilyINet)
	if err != nil {
		return nil, fmt.Errorf("list inet chains: %w", err)
	}
	var tables []*gnft.Table
	for _, name := range nft.Tables {
		for _, ch := range chains {
			if ch.Table.Name == nft.TableName(name) {
				tables = append(tables, ch.Table)
				break
			}
		}
	}
	var out []liveTable
	for _, t := range tables {
		sets, err := readSets(c, t)
		if err != nil {
			return nil, fmt.Errorf("table %s: %w", t.Name, err)
		}
		lt := liveTable{name: t.Name}
		for _, ch := range chains {
			if ch.Table.Name != t.Name {
				continue
			}
			rs, err := c.GetRules(t, ch)
			if err != nil {
				return nil, fmt.Errorf("table %s chain %s: list rules: %w", t.Name, ch.Name, err)
			}
			lc := liveChain{name: ch.Name, def: liveChainDef(ch)}
			for _, r := range rs {
				lc.rules = append(lc.rules, liveRule{key: fingerprint(r.Exprs, sets), text: decompile(r.Exprs, sets)})
			}
			lt.chains = append(lt.chains, lc)
		}
		out = append(out, lt)
	}
	return out, nil
}

// readSets returns the elements of the table's sets by name.
func readSets(c *gnft.Conn, t *gnft.Table) (map[string][][]byte, error) {
	sets, err := c.GetSets(t)
	if err != nil {
		return nil, fmt.Errorf("list sets: %w", err)
	}
	out := map[string][][]byte{}
	for _, s := range sets {
		elems, err := c.GetSetElements(s)
		if err != nil {
			return nil, fmt.Errorf("set %s: list elements: %w", s.Name, err)
		}
		for _, e := range elems {
			out[s.Name] = append(out[s.Name], e.Key)
		}
	}
	return out, nil
}

func chainDef(b *nft.BaseChain) string {
	if b == nil {
		return ""
	}
	return fmt.Sprintf("type %s hook %s priority %d", b.Type, b.Hook, b.Priority)
}

func liveChainDef(ch *gnft.Chain) string {
	if ch.Hooknum == nil {
		return ""
	}
	hook := fmt.Sprintf("%d", *ch.Hooknum)
	switch *ch.Hooknum {
	case *gnft.ChainHookPrerouting:
		hook = "prerouting"
	case *gnft.ChainHookOutput:
		hook = "output"
	case *gnft.ChainHookInput:
		hook = "input"
	case *gnft.ChainHookForward:
		hook = "forward"
	case *gnft.ChainHookPostrouting:
		hook = "postrouting"
	}
	prio := 0
	if ch.Priority != nil {
		prio = int(*ch.Priority)
	}
	return fmt.Sprintf("type %s hook %s priority %d", ch.Type, hook, prio)
}

// fingerprint is a canonical form of a rule's expressions: counter values, handles
// and set names/IDs are left out; a lookup stands for its set's sorted elements.
func fingerprint(es []expr.Any, sets map[string][][]byte) string {
	parts := make([]string, len(es))
	for i, e := range es {
		switch e := e.(type) {
		case *expr.Meta:
			parts[i] = fmt.Sprintf("meta k%d s%v r%d", e.Key, e.SourceRegister, e.Register)
		case *expr.Cmp:
			parts[i] = fmt.Sprintf("cmp o%d r%d %x", e.Op, e.Register, e.Data)
		case *expr.Payload:
			parts[i] = fmt.Sprintf("payload b%d o%d l%d r%d", e.Base, e.Offset, e.Len, e.DestRegister)
		case *expr.Bitwise:
			parts[i] = fmt.Sprintf("bitwise s%d d%d l%d m%x x%x", e.SourceRegister, e.DestRegister, e.Len, e.Mask, e.Xor)
		case *expr.Ct:
			if ctIsSet(e) {
				parts[i] = fmt.Sprintf("ct set k%d", e.Key)
			} else {
				parts[i] = fmt.Sprintf("ct k%d r%d", e.Key, e.Register)
			}
		case *expr.Immediate:
			parts[i] = fmt.Sprintf("imm r%d %x", e.Register, e.Data)
		case *expr.Verdict:
			parts[i] = fmt.Sprintf("verdict %d %s", e.Kind, e.Chain)
		case *expr.Counter:
			parts[i] = "counter"
		case *expr.Lookup:
			parts[i] = fmt.Sprintf("lookup r%d i%v {%s}", e.SourceRegister, e.Invert, setKey(e, sets))
		case *expr.Redir:
			// The kernel sets (and dumps) proto max = proto min when only min is given.
			pmax := e.RegisterProtoMax
			if pmax == 0 {
				pmax = e.RegisterProtoMin
			}
			parts[i] = fmt.Sprintf("redir %d %d %d", e.RegisterProtoMin, pmax, e.Flags)
		case *expr.TProxy:
			// github.com/google/nftables v0.3.0 cannot decode tproxy expressions: a
			// live rule comes back without it, so the fingerprint leaves it out on
			// both sides (the port immediate and the mark that follow still count).
			parts[i] = ""
		default:
			parts[i] = fmt.Sprintf("%T %+v", e, e)
		}
	}
	kept := parts[:0]
	for _, p := range parts {
		if p != "" {
			kept = append(kept, p)
		}
	}
	return strings.Join(kept, "; ")
}

// ctIsSet reports whether a ct expression writes the conntrack entry. The library
// does not decode NFTA_CT_SREG, so a decoded set statement shows as a load into
// register 0, the verdict register, which no load can target.
func ctIsSet(e *expr.Ct) bool { return e.SourceRegister || e.Register == 0 }

func setKey(l *expr.Lookup, sets map[string][][]byte) string {
	elems := sets[l.SetName]
	hex := make([]string, len(elems))
	for i, e := range elems {
		hex[i] = fmt.Sprintf("%x", e)
	}
	sort.Strings(hex)
	return strings.Join(hex, ",")
}

// desiredSets maps a compiled rule's lookups to their elements, under synthetic
// names, for fingerprinting.
func desiredKey(cr compiledRule) string {
	sets := map[string][][]byte{}
	for i, s := range cr.sets {
		name := fmt.Sprintf("desired%d", i)
		s.lookup.SetName = name
		sets[name] = s.elems
	}
	return fingerprint(cr.exprs, sets)
}

// Check compares meshcni's live tables with the ruleset. Each drift entry reads
// "<table> <chain>: <rule>", with the renderer's text for missing rules and the
// decompiled live text for unexpected ones.
func (b *Backend) Check(ctx context.Context, netnsPath string, rs *rules.Ruleset) (backend.Drift, error) {
	var d backend.Drift
	if err := ctx.Err(); err != nil {
		return d, err
	}
	desired, err := b.compile(rs)
	if err != nil {
		return d, fmt.Errorf("nftables check: %w", err)
	}
	c, closeConn, err := Dial(netnsPath, nil)
	if err != nil {
		return d, fmt.Errorf("nftables check: %w", err)
	}
	defer closeConn()
	live, err := readLive(c)
	if err != nil {
		return d, fmt.Errorf("nftables check in netns %q: %w", netnsPath, err)
	}
	liveChains := map[string]liveChain{}
	for _, lt := range live {
		for _, lc := range lt.chains {
			liveChains[lt.name+" "+lc.name] = lc
		}
	}
	seen := map[string]bool{}
	for _, dt := range desired {
		for _, dc := range dt.chains {
			id := dt.name + " " + dc.name
			seen[id] = true
			lc, ok := liveChains[id]
			if want := chainDef(dc.base); !ok || lc.def != want {
				if want != "" || !ok {
					d.Missing = append(d.Missing, fmt.Sprintf("%s: chain %s", id, orRegular(want)))
				}
				if ok {
					d.Unexpected = append(d.Unexpected, fmt.Sprintf("%s: chain %s", id, orRegular(lc.def)))
				}
			}
			want := make([]string, len(dc.rules))
			for i, cr := range dc.rules {
				want[i] = desiredKey(cr)
			}
			got := make([]string, len(lc.rules))
			for i, r := range lc.rules {
				got[i] = r.key
			}
			miss, extra := diffSeq(want, got)
			for _, i := range miss {
				d.Missing = append(d.Missing, fmt.Sprintf("%s: %s", id, dc.rules[i].text))
			}
			for _, i := range extra {
				d.Unexpected = append(d.Unexpected, fmt.Sprintf("%s: %s", id, lc.rules[i].text))
			}
		}
	}
	for _, lt := range live {
		for _, lc := range lt.chains {
			id := lt.name + " " + lc.name
			if seen[id] {
				continue
			}
			d.Unexpected = append(d.Unexpected, fmt.Sprintf("%s: chain %s", id, orRegular(lc.def)))
			for _, r := range lc.rules {
				d.Unexpected = append(d.Unexpected, fmt.Sprintf("%s: %s", id, r.text))
			}
		}
	}
	return d, nil
}

func orRegular(def string) string {
	if def == "" {
		return "(regular)"
	}
	return "{ " + def + " }"
}

// diffSeq returns the indexes of want and got outside a longest common subsequence:
// the missing and the unexpected entries, order kept.
func diffSeq(want, got []string) (missing, unexpected []int) {
	n, m := len(want), len(got)
	l := make([][]int, n+1)
	for i := range l {
		l[i] = make([]int, m+1)
	}
	for i := n - 1; i >= 0; i-- {
		for j := m - 1; j >= 0; j-- {
			if want[i] == got[j] {
				l[i][j] = l[i+1][j+1] + 1
			} else {
				l[i][j] = max(l[i+1][j], l[i][j+1])
			}
		}
	}
	i, j := 0, 0
	for i < n && j < m {
		switch {
		case want[i] == got[j]:
			i, j = i+1, j+1
		case l[i+1][j] >= l[i][j+1]:
			missing = append(missing, i)
			i++
		default:
			unexpected = append(unexpected, j)
			j++
		}
	}
	for ; i < n; i++ {
		missing = append(missing, i)
	}
	for ; j < m; j++ {
		unexpected = append(unexpected, j)
	}
	return missing, unexpected
}

// Live returns meshcni's live tables as nft-like text, decompiled from the
// expressions read over netlink.
func (b *Backend) Live(ctx context.Context, netnsPath string) (string, error) {
	if err := ctx.Err(); err != nil {
		return "", err
	}
	c, closeConn, err := Dial(netnsPath, nil)
	if err != nil {
		return "", fmt.Errorf("nftables live: %w", err)
	}
	defer closeConn()
	live, err := readLive(c)
	if err != nil {
		return "", fmt.Errorf("nftables live in netns %q: %w", netnsPath, err)
	}
	var sb strings.Builder
	for _, lt := range live {
		fmt.Fprintf(&sb, "table inet %s {\n", lt.name)
		for _, lc := range lt.chains {
			fmt.Fprintf(&sb, "\tchain %s {\n", lc.name)
			if lc.def != "" {
				fmt.Fprintf(&sb, "\t\t%s;\n", lc.def)
			}
			for _, r := range lc.rules {
				fmt.Fprintf(&sb, "\t\t%s\n", r.text)
			}
			sb.WriteString("\t}\n")
		}
		sb.WriteString("}\n")
	}
	return sb.String(), nil
}

// decompile renders expressions as nft statements, for the patterns this backend
// writes (and nft writes for the same statements); anything else is shown raw.
func decompile(es []expr.Any, sets map[string][][]byte) string {
	var out []string
	var l4 byte
	neg := func(op expr.CmpOp) string {
		if op == expr.CmpOpNeq {
			return "!= "
		}
		return ""
	}
	next := func(i int) expr.Any {
		if i+1 < len(es) {
			return es[i+1]
		}
		return nil
	}
	for i := 0; i < len(es); i++ {
		switch e := es[i].(type) {
		case *expr.Meta:
			if e.SourceRegister {
				out = append(out, "meta "+metaName(e.Key)+" set <reg>")
				continue
			}
			cmp, isCmp := next(i).(*expr.Cmp)
			switch {
			case isCmp && (e.Key == expr.MetaKeyIIFNAME || e.Key == expr.MetaKeyOIFNAME):
				out = append(out, metaName(e.Key)+" "+neg(cmp.Op)+string(bytes.TrimRight(cmp.Data, "\x00")))
				i++
			case isCmp && e.Key == expr.MetaKeyL4PROTO && len(cmp.Data) == 1:
				l4 = cmp.Data[0]
				i++
				if p, ok := next(i).(*expr.Payload); ok && p.Base == expr.PayloadBaseTransportHeader {
					continue // implicit dependency of the port match
				}
				out = append(out, "meta l4proto "+protoName(l4))
			case isCmp && e.Key == expr.MetaKeyNFPROTO:
				i++
				if p, ok := next(i).(*expr.Payload); ok && p.Base == expr.PayloadBaseNetworkHeader {
					continue
				}
				out = append(out, "meta nfproto "+nfprotoName(cmp.Data[0]))
			case isCmp && len(cmp.Data) == 4:
				out = append(out, metaName(e.Key)+" "+neg(cmp.Op)+strconv.FormatUint(uint64(binaryutil.NativeEndian.Uint32(cmp.Data)), 10))
				i++
			default:
				if ct, ok := next(i).(*expr.Ct); ok && ctIsSet(ct) && e.Key == expr.MetaKeyMARK && ct.Key == expr.CtKeyMARK {
					out = append(out, "ct mark set mark")
					i++
					continue
				}
				out = append(out, "meta "+metaName(e.Key))
			}
		case *expr.Ct:
			if ctIsSet(e) {
				out = append(out, "ct "+ctName(e.Key)+" set <reg>")
				continue
			}
			if m, ok := next(i).(*expr.Meta); ok && m.SourceRegister && m.Key == expr.MetaKeyMARK && e.Key == expr.CtKeyMARK {
				out = append(out, "meta mark set ct mark")
				i++
				continue
			}
			if bw, ok := next(i).(*expr.Bitwise); ok && e.Key == expr.CtKeySTATE && i+2 < len(es) {
				if _, ok := es[i+2].(*expr.Cmp); ok && len(bw.Mask) == 4 {
					out = append(out, "ct state "+ctStateText(binaryutil.NativeEndian.Uint32(bw.Mask)))
					i += 2
					continue
				}
			}
			if cmp, ok := next(i).(*expr.Cmp); ok && len(cmp.Data) == 4 {
				out = append(out, "ct "+ctName(e.Key)+" "+neg(cmp.Op)+strconv.FormatUint(uint64(binaryutil.NativeEndian.Uint32(cmp.Data)), 10))
				i++
				continue
			}
			out = append(out, "ct "+ctName(e.Key))
		case *expr.Payload:
			if text, n := payloadText(es[i:], l4, sets); n > 0 {
				out = append(out, text)
				i += n - 1
				continue
			}
			out = append(out, fmt.Sprintf("payload %+v", *e))
		case *expr.Counter:
			out = append(out, "counter")
		case *expr.Immediate:
			switch nx := next(i).(type) {
			case *expr.Redir:
				out = append(out, fmt.Sprintf("redirect to :%d", binaryutil.BigEndian.Uint16(e.Data)))
				i++
				continue
			case *expr.TProxy:
				fam := map[byte]string{unix.NFPROTO_IPV4: "ip ", unix.NFPROTO_IPV6: "ip6 "}[nx.Family]
				out = append(out, fmt.Sprintf("tproxy %sto :%d", fam, binaryutil.BigEndian.Uint16(e.Data)))
				i++
				continue
			case *expr.Meta:
				if nx.SourceRegister && len(e.Data) == 4 {
					out = append(out, fmt.Sprintf("meta %s set %d", metaName(nx.Key), binaryutil.NativeEndian.Uint32(e.Data)))
					i++
					continue
				}
			case *expr.Ct:
				if ctIsSet(nx) && nx.Key == expr.CtKeyZONE && len(e.Data) == 2 {
					out = append(out, fmt.Sprintf("ct zone set %d", binaryutil.NativeEndian.Uint16(e.Data)))
					i++
					continue
				}
			}
			if len(e.Data) == 2 && e.Register == 1 {
				// A port loaded for a statement the library could not decode: in
				// meshcni's tables only tproxy does that.
				out = append(out, fmt.Sprintf("tproxy to :%d", binaryutil.BigEndian.Uint16(e.Data)))
				continue
			}
			out = append(out, fmt.Sprintf("immediate %x", e.Data))
		case *expr.Verdict:
			switch e.Kind {
			case expr.VerdictJump:
				out = append(out, "jump "+e.Chain)
			case expr.VerdictGoto:
				out = append(out, "goto "+e.Chain)
			case expr.VerdictReturn:
				out = append(out, "return")
			case expr.VerdictAccept:
				out = append(out, "accept")
			case expr.VerdictDrop:
				out = append(out, "drop")
			default:
				out = append(out, fmt.Sprintf("verdict %d", e.Kind))
			}
		default:
			out = append(out, fmt.Sprintf("<%T %+v>", e, e))
		}
	}
	return strings.Join(out, " ")
}

// payloadText decompiles an address or port match starting at es[0], returning the
// text and the number of expressions used (0 if not recognized).
func payloadText(es []expr.Any, l4 byte, sets map[string][][]byte) (string, int) {
	p := es[0].(*expr.Payload)
	neg := func(op expr.CmpOp) string {
		if op == expr.CmpOpNeq {
			return "!= "
		}
		return ""
	}
	switch p.Base {
	case expr.PayloadBaseTransportHeader:
		dir := map[uint32]string{0: "sport", 2: "dport"}[p.Offset]
		if dir == "" || p.Len != 2 || len(es) < 2 {
			return "", 0
		}
		switch m := es[1].(type) {
		case *expr.Cmp:
			return fmt.Sprintf("%s %s %s%d", protoName(l4), dir, neg(m.Op), binaryutil.BigEndian.Uint16(m.Data)), 2
		case *expr.Lookup:
			var ports []uint16
			for _, e := range sets[m.SetName] {
				if len(e) == 2 {
					ports = append(ports, binaryutil.BigEndian.Uint16(e))
				}
			}
			n := ""
			if m.Invert {
				n = "!= "
			}
			return fmt.Sprintf("%s %s %s%s", protoName(l4), dir, n, nft.PortsText(ports)), 2
		}
	case expr.PayloadBaseNetworkHeader:
		var kw, dir string
		size := 4
		switch p.Offset {
		case 12:
			kw, dir = "ip", "saddr"
		case 16:
			kw, dir = "ip", "daddr"
		case 8:
			kw, dir, size = "ip6", "saddr", 16
		case 24:
			kw, dir, size = "ip6", "daddr", 16
		default:
			return "", 0
		}
		var mask []byte
		n := 1
		if bw, ok := es[n].(*expr.Bitwise); ok && len(es) > 2 {
			mask = bw.Mask
			n++
		}
		cmp, ok := es[n].(*expr.Cmp)
		if !ok {
			return "", 0
		}
		full := make([]byte, size)
		copy(full, cmp.Data)
		addr, ok := netip.AddrFromSlice(full)
		if !ok {
			return "", 0
		}
		bits := len(cmp.Data) * 8
		if mask != nil {
			bits = 0
			for _, b := range mask {
				for ; b&0x80 != 0; b <<= 1 {
					bits++
				}
			}
		}
		return fmt.Sprintf("%s %s %s%s", kw, dir, neg(cmp.Op), netip.PrefixFrom(addr, bits)), n + 1
	}
	return "", 0
}

func protoName(p byte) string {
	switch p {
	case unix.IPPROTO_TCP:
		return "tcp"
	case unix.IPPROTO_UDP:
		return "udp"
	case unix.IPPROTO_ICMPV6:
		return "ipv6-icmp"
	}
	return strconv.Itoa(int(p))
}

func nfprotoName(p byte) string {
	switch p {
	case unix.NFPROTO_IPV4:
		return "ipv4"
	case unix.NFPROTO_IPV6:
		return "ipv6"
	}
	return strconv.Itoa(int(p))
}

func metaName(k expr.MetaKey) string {
	switch k {
	case expr.MetaKeyIIFNAME:
		return "iifname"
	case expr.MetaKeyOIFNAME:
		return "oifname"
	case expr.MetaKeyL4PROTO:
		return "l4proto"
	case expr.MetaKeyNFPROTO:
		return "nfproto"
	case expr.MetaKeySKUID:
		return "skuid"
	case expr.MetaKeySKGID:
		return "skgid"
	case expr.MetaKeyMARK:
		return "mark"
	}
	return fmt.Sprintf("key%d", k)
}

func ctName(k expr.CtKey) string {
	switch k {
	case expr.CtKeySTATE:
		return "state"
	case expr.CtKeyMARK:
		return "mark"
	case expr.CtKeyZONE:
		return "zone"
	}
	return fmt.Sprintf("key%d", k)
}

func ctStateText(mask uint32) string {
	var out []string
	if mask&ctStateInvalid != 0 {
		out = append(out, "invalid")
	}
	if mask&ctStateEstablished != 0 {
		out = append(out, "established")
	}
	if mask&ctStateRelated != 0 {
		out = append(out, "related")
	}
	return strings.Join(out, ",")
}
