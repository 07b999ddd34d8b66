package nftables

import (
	"bytes"
	"fmt"
	"net/netip"
	"strconv"
	"strings"

	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/pkg/rules/nft"
)

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
