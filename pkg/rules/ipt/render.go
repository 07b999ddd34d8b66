// Package ipt renders the rules model as iptables-restore input and as
// iptables command arguments, for one IP family. It is pure.
package ipt

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/meshcni/meshcni/pkg/rules"
)

// Tables lists the tables meshcni writes, in the order they are rendered.
var Tables = []string{rules.TableMangle, rules.TableNat, rules.TableRaw}

// RuleArgs renders one rule's match and target as iptables arguments (without
// "-A CHAIN"). Values are typed in the model, so nothing here needs quoting.
func RuleArgs(r rules.Rule) []string {
	var a []string
	m := r.Match
	if m.Src.Prefix.IsValid() {
		a = appendNeg(a, m.Src.Neg, "-s", m.Src.Prefix.String())
	}
	if m.Dst.Prefix.IsValid() {
		a = appendNeg(a, m.Dst.Neg, "-d", m.Dst.Prefix.String())
	}
	if m.In.Name != "" {
		a = appendNeg(a, m.In.Neg, "-i", m.In.Name)
	}
	if m.Out.Name != "" {
		a = appendNeg(a, m.Out.Neg, "-o", m.Out.Name)
	}
	if m.Proto != rules.AnyProto {
		a = append(a, "-p", m.Proto.String())
	}
	if len(m.SPorts.Ports) > 0 {
		a = appendPorts(a, m.Proto, m.SPorts, "--sport", "--sports")
	}
	if len(m.DPorts.Ports) > 0 {
		a = appendPorts(a, m.Proto, m.DPorts, "--dport", "--dports")
	}
	for _, o := range m.Owners {
		a = append(a, "-m", "owner")
		if o.UID != nil {
			a = appendNeg(a, o.Neg, "--uid-owner", strconv.FormatUint(uint64(*o.UID), 10))
		} else {
			a = appendNeg(a, o.Neg, "--gid-owner", o.Group)
		}
	}
	if m.Mark != nil {
		a = append(a, "-m", "mark")
		a = appendNeg(a, m.Mark.Neg, "--mark", strconv.FormatUint(uint64(m.Mark.Value), 10))
	}
	if m.ConnMark != nil {
		a = append(a, "-m", "connmark")
		a = appendNeg(a, m.ConnMark.Neg, "--mark", strconv.FormatUint(uint64(m.ConnMark.Value), 10))
	}
	if m.CTState != 0 {
		a = append(a, "-m", "conntrack", "--ctstate", ctStates(m.CTState))
	}
	return append(a, targetArgs(r.Verdict)...)
}

func appendNeg(a []string, neg bool, flag, value string) []string {
	if neg {
		a = append(a, "!")
	}
	return append(a, flag, value)
}

func appendPorts(a []string, proto rules.Proto, pm rules.PortMatch, one, many string) []string {
	if len(pm.Ports) == 1 {
		return appendNeg(a, pm.Neg, one, strconv.Itoa(int(pm.Ports[0])))
	}
	ps := make([]string, len(pm.Ports))
	for i, p := range pm.Ports {
		ps[i] = strconv.Itoa(int(p))
	}
	a = append(a, "-m", "multiport")
	return appendNeg(a, pm.Neg, many, strings.Join(ps, ","))
}

func ctStates(s rules.CTState) string {
	return strings.ToUpper(strings.Join(s.Names(), ","))
}

func targetArgs(v rules.Verdict) []string {
	u := func(n uint32) string { return strconv.FormatUint(uint64(n), 10) }
	switch v.Kind {
	case rules.Jump:
		return []string{"-j", v.Chain}
	case rules.Return:
		return []string{"-j", "RETURN"}
	case rules.Accept:
		return []string{"-j", "ACCEPT"}
	case rules.Drop:
		return []string{"-j", "DROP"}
	case rules.Redirect:
		return []string{"-j", "REDIRECT", "--to-ports", strconv.Itoa(int(v.Port))}
	case rules.TProxy:
		return []string{"-j", "TPROXY", "--tproxy-mark", u(v.Mark) + "/0xffffffff", "--on-port", strconv.Itoa(int(v.Port))}
	case rules.SetMark:
		return []string{"-j", "MARK", "--set-mark", u(v.Mark)}
	case rules.SaveMark:
		return []string{"-j", "CONNMARK", "--save-mark"}
	case rules.RestoreMark:
		return []string{"-j", "CONNMARK", "--restore-mark"}
	case rules.CTZone:
		return []string{"-j", "CT", "--zone", strconv.Itoa(int(v.Zone))}
	}
	panic(fmt.Sprintf("iptables: unknown verdict kind %d", v.Kind))
}

// Restore renders the ruleset for one family (rules.V4 or rules.V6) as input for
// `iptables-restore --noflush`: per table, the chains meshcni creates, then its rules
// in final order. It returns "" when the family has nothing to write.
func Restore(rs *rules.Ruleset, family rules.Family) string {
	var sb strings.Builder
	for _, t := range order(rs.Resolve(family)) {
		fmt.Fprintf(&sb, "*%s\n", t.Name)
		for _, c := range t.Chains {
			if !rules.IsBuiltin(c.Name) {
				fmt.Fprintf(&sb, ":%s - [0:0]\n", c.Name)
			}
		}
		for _, c := range t.Chains {
			for _, r := range c.Rules {
				fmt.Fprintf(&sb, "-A %s %s\n", c.Name, strings.Join(RuleArgs(r), " "))
			}
		}
		sb.WriteString("COMMIT\n")
	}
	return sb.String()
}

// order sorts resolved tables as Tables lists them.
func order(ts []rules.ResolvedTable) []rules.ResolvedTable {
	var out []rules.ResolvedTable
	for _, name := range Tables {
		for _, t := range ts {
			if t.Name == name {
				out = append(out, t)
			}
		}
	}
	return out
}
