package nftables

import (
	"fmt"
	"net/netip"

	gnft "github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/pkg/rules"
	"github.com/meshcni/meshcni/pkg/rules/nft"
)

// ifNameSize is IFNAMSIZ: interface names are compared as 16 NUL-padded bytes.
const ifNameSize = 16

// anonSet is an anonymous constant set a rule looks ports up in.
type anonSet struct {
	keyType gnft.SetDatatype
	elems   [][]byte
	lookup  *expr.Lookup
}

// compiledRule is one rule as netlink expressions, with the sets it needs.
type compiledRule struct {
	text  string // the renderer's text, for errors and drift
	exprs []expr.Any
	sets  []anonSet
}

// compiler turns the renderer's statements into expressions the way nft does,
// including its implicit dependencies: `meta nfproto` before the first IPv4/IPv6
// address match, `meta l4proto` before a port match whose protocol is not yet known.
type compiler struct {
	groups *groupResolver
}

func (c *compiler) rule(table, chain string, r rules.Rule) (compiledRule, error) {
	stmts := nft.Statements(table, chain, r)
	out := compiledRule{text: nft.RuleText(table, chain, r)}
	var nfproto rules.Family
	var l4 rules.Proto
	add := func(es ...expr.Any) { out.exprs = append(out.exprs, es...) }
	cmpOp := func(neg bool) expr.CmpOp {
		if neg {
			return expr.CmpOpNeq
		}
		return expr.CmpOpEq
	}
	for _, s := range stmts {
		switch s.Kind {
		case nft.IIFName, nft.OIFName:
			name, err := ifname(s.Name)
			if err != nil {
				return out, err
			}
			key := expr.MetaKeyIIFNAME
			if s.Kind == nft.OIFName {
				key = expr.MetaKeyOIFNAME
			}
			add(&expr.Meta{Key: key, Register: 1}, &expr.Cmp{Op: cmpOp(s.Neg), Register: 1, Data: name})
		case nft.NFProto:
			np := byte(unix.NFPROTO_IPV4)
			if s.Family == rules.V6 {
				np = unix.NFPROTO_IPV6
			}
			add(&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1}, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{np}})
			nfproto = s.Family
		case nft.L4Proto:
			p, err := l4Num(s.Proto)
			if err != nil {
				return out, err
			}
			add(&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1}, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{p}})
			l4 = s.Proto
		case nft.CTState:
			add(&expr.Ct{Key: expr.CtKeySTATE, Register: 1},
				&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: binaryutil.NativeEndian.PutUint32(ctStateBits(s.State)), Xor: make([]byte, 4)},
				&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: make([]byte, 4)})
		case nft.SAddr, nft.DAddr:
			fam := rules.V4
			if s.Prefix.Addr().Is6() {
				fam = rules.V6
			}
			if nfproto != fam {
				np := byte(unix.NFPROTO_IPV4)
				if fam == rules.V6 {
					np = unix.NFPROTO_IPV6
				}
				add(&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1}, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{np}})
				nfproto = fam
			}
			add(prefixExprs(s.Prefix, s.Kind == nft.SAddr, s.Neg)...)
		case nft.SPort, nft.DPort:
			if len(s.Ports) == 0 {
				return out, fmt.Errorf("empty port match")
			}
			if l4 != s.Proto {
				p, err := protoNum(s.Proto)
				if err != nil {
					return out, fmt.Errorf("port match: %w", err)
				}
				add(&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1}, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{p}})
				l4 = s.Proto
			}
			off := uint32(2)
			if s.Kind == nft.SPort {
				off = 0
			}
			add(&expr.Payload{OperationType: expr.PayloadLoad, DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: off, Len: 2})
			if len(s.Ports) == 1 {
				add(&expr.Cmp{Op: cmpOp(s.Neg), Register: 1, Data: binaryutil.BigEndian.PutUint16(s.Ports[0])})
				break
			}
			lk := &expr.Lookup{SourceRegister: 1, Invert: s.Neg}
			set := anonSet{keyType: gnft.TypeInetService, lookup: lk}
			for _, p := range s.Ports {
				set.elems = append(set.elems, binaryutil.BigEndian.PutUint16(p))
			}
			out.sets = append(out.sets, set)
			add(lk)
		case nft.SKUID:
			add(&expr.Meta{Key: expr.MetaKeySKUID, Register: 1}, &expr.Cmp{Op: cmpOp(s.Neg), Register: 1, Data: binaryutil.NativeEndian.PutUint32(s.Value)})
		case nft.SKGID:
			gid, err := c.groups.gid(s.Group)
			if err != nil {
				return out, err
			}
			add(&expr.Meta{Key: expr.MetaKeySKGID, Register: 1}, &expr.Cmp{Op: cmpOp(s.Neg), Register: 1, Data: binaryutil.NativeEndian.PutUint32(gid)})
		case nft.Mark:
			add(&expr.Meta{Key: expr.MetaKeyMARK, Register: 1}, &expr.Cmp{Op: cmpOp(s.Neg), Register: 1, Data: binaryutil.NativeEndian.PutUint32(s.Value)})
		case nft.CTMark:
			add(&expr.Ct{Key: expr.CtKeyMARK, Register: 1}, &expr.Cmp{Op: cmpOp(s.Neg), Register: 1, Data: binaryutil.NativeEndian.PutUint32(s.Value)})
		case nft.Counter:
			add(&expr.Counter{})
		case nft.Jump:
			add(&expr.Verdict{Kind: expr.VerdictJump, Chain: s.Name})
		case nft.Return:
			add(&expr.Verdict{Kind: expr.VerdictReturn})
		case nft.Accept:
			add(&expr.Verdict{Kind: expr.VerdictAccept})
		case nft.Drop:
			add(&expr.Verdict{Kind: expr.VerdictDrop})
		case nft.Redirect:
			add(&expr.Immediate{Register: 1, Data: binaryutil.BigEndian.PutUint16(uint16(s.Value))},
				&expr.Redir{RegisterProtoMin: 1, Flags: unix.NF_NAT_RANGE_PROTO_SPECIFIED})
		case nft.TProxy:
			fam := byte(unix.NFPROTO_UNSPEC)
			switch s.Family {
			case rules.V4:
				fam = unix.NFPROTO_IPV4
			case rules.V6:
				fam = unix.NFPROTO_IPV6
			}
			add(&expr.Immediate{Register: 1, Data: binaryutil.BigEndian.PutUint16(uint16(s.Value))},
				&expr.TProxy{Family: fam, TableFamily: unix.NFPROTO_INET, RegPort: 1})
		case nft.SetMark:
			add(&expr.Immediate{Register: 1, Data: binaryutil.NativeEndian.PutUint32(s.Value)},
				&expr.Meta{Key: expr.MetaKeyMARK, SourceRegister: true, Register: 1})
		case nft.SaveMark:
			add(&expr.Meta{Key: expr.MetaKeyMARK, Register: 1}, &expr.Ct{Key: expr.CtKeyMARK, SourceRegister: true, Register: 1})
		case nft.RestoreMark:
			add(&expr.Ct{Key: expr.CtKeyMARK, Register: 1}, &expr.Meta{Key: expr.MetaKeyMARK, SourceRegister: true, Register: 1})
		case nft.CTZone:
			add(&expr.Immediate{Register: 1, Data: binaryutil.NativeEndian.PutUint16(uint16(s.Value))},
				&expr.Ct{Key: expr.CtKeyZONE, SourceRegister: true, Register: 1})
		default:
			return out, fmt.Errorf("statement %q: not supported by the native backend", s.String())
		}
	}
	return out, nil
}

func ifname(name string) ([]byte, error) {
	if name == "" || len(name) >= ifNameSize {
		return nil, fmt.Errorf("interface name %q: must be 1-%d bytes", name, ifNameSize-1)
	}
	b := make([]byte, ifNameSize)
	copy(b, name)
	return b, nil
}

// l4Num is the protocol number of a `meta l4proto` match.
func l4Num(p rules.Proto) (byte, error) {
	if p == rules.ICMPv6 {
		return unix.IPPROTO_ICMPV6, nil
	}
	return protoNum(p)
}

func protoNum(p rules.Proto) (byte, error) {
	switch p {
	case rules.TCP:
		return unix.IPPROTO_TCP, nil
	case rules.UDP:
		return unix.IPPROTO_UDP, nil
	}
	return 0, fmt.Errorf("port match needs tcp or udp, got protocol %d", p)
}

// Conntrack state bits as the kernel defines them (NF_CT_STATE_BIT).
const (
	ctStateInvalid     = 1
	ctStateEstablished = 2
	ctStateRelated     = 4
)

func ctStateBits(s rules.CTState) uint32 {
	var b uint32
	if s&rules.CTInvalid != 0 {
		b |= ctStateInvalid
	}
	if s&rules.CTEstablished != 0 {
		b |= ctStateEstablished
	}
	if s&rules.CTRelated != 0 {
		b |= ctStateRelated
	}
	return b
}

// prefixExprs loads and compares an address prefix as nft does: a whole-byte prefix
// loads only its bytes; any other length loads the full address and masks it.
func prefixExprs(p netip.Prefix, src, neg bool) []expr.Any {
	p = p.Masked()
	addr := p.Addr().AsSlice()
	var off uint32
	switch {
	case p.Addr().Is4() && src:
		off = 12
	case p.Addr().Is4():
		off = 16
	case src:
		off = 8
	default:
		off = 24
	}
	op := expr.CmpOpEq
	if neg {
		op = expr.CmpOpNeq
	}
	bits := p.Bits()
	if bits > 0 && bits%8 == 0 {
		n := uint32(bits / 8)
		return []expr.Any{
			&expr.Payload{OperationType: expr.PayloadLoad, DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: off, Len: n},
			&expr.Cmp{Op: op, Register: 1, Data: addr[:n]},
		}
	}
	mask := make([]byte, len(addr))
	for i := 0; i < bits; i++ {
		mask[i/8] |= 0x80 >> (i % 8)
	}
	return []expr.Any{
		&expr.Payload{OperationType: expr.PayloadLoad, DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: off, Len: uint32(len(addr))},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: uint32(len(addr)), Mask: mask, Xor: make([]byte, len(addr))},
		&expr.Cmp{Op: op, Register: 1, Data: addr},
	}
}
