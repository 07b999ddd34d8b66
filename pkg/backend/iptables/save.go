package iptables

import (
	"strings"
)

// savedTable is one table of iptables-save output.
type savedTable struct {
	Name   string
	Header []string            // ":CHAIN POLICY [x:y]" lines, in order
	Chains []string            // chain names in order
	Rules  map[string][]string // chain → rule specs (without "-A CHAIN ")
}

// parseSave parses iptables-save output. Comments and counters on chain lines are
// kept in Header verbatim (used only for rollback).
func parseSave(out string) []*savedTable {
	var tables []*savedTable
	var cur *savedTable
	for _, line := range strings.Split(out, "\n") {
		switch {
		case line == "" || strings.HasPrefix(line, "#"):
		case strings.HasPrefix(line, "*"):
			cur = &savedTable{Name: strings.TrimPrefix(line, "*"), Rules: map[string][]string{}}
			tables = append(tables, cur)
		case cur == nil:
		case line == "COMMIT":
			cur = nil
		case strings.HasPrefix(line, ":"):
			cur.Header = append(cur.Header, line)
			name, _, _ := strings.Cut(line[1:], " ")
			cur.Chains = append(cur.Chains, name)
		case strings.HasPrefix(line, "-A "):
			chain, rest, _ := strings.Cut(line[3:], " ")
			if _, ok := cur.Rules[chain]; !ok && !contains(cur.Chains, chain) {
				cur.Chains = append(cur.Chains, chain)
			}
			cur.Rules[chain] = append(cur.Rules[chain], rest)
		}
	}
	return tables
}

func findTable(ts []*savedTable, name string) *savedTable {
	for _, t := range ts {
		if t.Name == name {
			return t
		}
	}
	return nil
}

// render writes the table back as restore input (for rollback without --noflush).
func (t *savedTable) render(sb *strings.Builder) {
	sb.WriteString("*" + t.Name + "\n")
	for _, h := range t.Header {
		sb.WriteString(h + "\n")
	}
	for _, c := range t.Chains {
		for _, r := range t.Rules[c] {
			sb.WriteString("-A " + c + " " + r + "\n")
		}
	}
	sb.WriteString("COMMIT\n")
}

// Normalize returns iptables-save output without comments and counters, and
// without tables that hold no rule and no user chain (the kernel instantiates empty
// tables on first use), so two states can be compared.
func Normalize(out string) string {
	var sb strings.Builder
	for _, t := range parseSave(out) {
		n := 0
		for _, c := range t.Chains {
			n += len(t.Rules[c])
		}
		if n == 0 && len(t.Chains) == countBuiltin(t.Chains) {
			continue
		}
		sb.WriteString("*" + t.Name + "\n")
		for _, h := range t.Header {
			name, rest, _ := strings.Cut(h[1:], " ")
			policy, _, _ := strings.Cut(rest, " ")
			sb.WriteString(":" + name + " " + policy + "\n")
		}
		for _, c := range t.Chains {
			for _, r := range t.Rules[c] {
				sb.WriteString("-A " + c + " " + r + "\n")
			}
		}
		sb.WriteString("COMMIT\n")
	}
	return sb.String()
}

func countBuiltin(chains []string) int {
	n := 0
	for _, c := range chains {
		switch c {
		case "PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING":
			n++
		}
	}
	return n
}

func contains(ss []string, s string) bool {
	for _, x := range ss {
		if x == s {
			return true
		}
	}
	return false
}
