package nftables

import (
	"context"
	"fmt"
	"sort"
	"strings"

	gnft "github.com/google/nftables"
	"github.com/google/nftables/expr"

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
