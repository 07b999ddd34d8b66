package spec

import (
	"errors"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
)

// Limits that keep a spec (and the rules rendered from it) bounded.
const (
	MaxListItems = 256 // ports, prefixes, interfaces or IDs in one list
	maxIfaceName = 15  // IFNAMSIZ - 1
	maxGroupName = 32
)

// splitList splits a comma-separated list, trimming spaces and dropping empty items
// (Istio accepts "6000,7000," and " a, b").
func splitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

// ParsePort parses one TCP/UDP port, 1-65535.
func ParsePort(field, s string) (uint16, error) {
	v := strings.TrimSpace(s)
	n, err := strconv.ParseUint(v, 10, 16)
	if err != nil || n == 0 {
		return 0, &FieldError{Field: field, Value: s, Reason: "a port must be a whole number from 1 to 65535"}
	}
	return uint16(n), nil
}

// ParseExcludePortList parses a list of ports to exclude: as ParsePortList, but port
// 0 is accepted and dropped — Istio writes it as a rule that matches nothing.
func ParseExcludePortList(field, s string) ([]uint16, error) {
	var kept []string
	for _, it := range splitList(s) {
		if it != "0" {
			kept = append(kept, it)
		}
	}
	out, err := ParsePortList(field, strings.Join(kept, ","))
	var fe *FieldError
	if errors.As(err, &fe) {
		fe.Value = s // report what was written, not the filtered list
	}
	return out, err
}

// ParsePortList parses "80,443" (no wildcard). Duplicates are dropped, order kept.
func ParsePortList(field, s string) ([]uint16, error) {
	items := splitList(s)
	if len(items) > MaxListItems {
		return nil, &FieldError{Field: field, Value: s, Reason: fmt.Sprintf("more than %d ports", MaxListItems)}
	}
	var out []uint16
	seen := map[uint16]bool{}
	for _, it := range items {
		if it == "*" {
			return nil, &FieldError{Field: field, Value: s, Reason: "'*' is not allowed here"}
		}
		p, err := ParsePort(field, it)
		if err != nil {
			return nil, &FieldError{Field: field, Value: s, Reason: fmt.Sprintf("%q: a port must be a whole number from 1 to 65535", it)}
		}
		if !seen[p] {
			seen[p] = true
			out = append(out, p)
		}
	}
	return out, nil
}

// ParsePortSet parses "*" (all ports), "" (none) or a port list.
func ParsePortSet(field, s string) (PortSet, error) {
	if strings.TrimSpace(s) == "*" {
		return PortSet{All: true}, nil
	}
	ports, err := ParsePortList(field, s)
	if err != nil {
		return PortSet{}, err
	}
	return PortSet{Ports: ports}, nil
}

// ParsePrefix parses a CIDR ("10.0.0.0/8") or a bare address (taken as /32 or /128).
// The prefix is masked ("10.1.2.3/8" → "10.0.0.0/8") as the kernel stores it.
func ParsePrefix(field, s string) (netip.Prefix, error) {
	v := strings.TrimSpace(s)
	if !strings.Contains(v, "/") {
		a, err := netip.ParseAddr(v)
		if err != nil || a.Zone() != "" {
			return netip.Prefix{}, &FieldError{Field: field, Value: s, Reason: "not an IP address or CIDR"}
		}
		a = a.Unmap()
		return netip.PrefixFrom(a, a.BitLen()), nil
	}
	p, err := netip.ParsePrefix(v)
	if err != nil {
		return netip.Prefix{}, &FieldError{Field: field, Value: s, Reason: "not a CIDR (want e.g. 10.0.0.0/8 or fd00::/8)"}
	}
	if p.Addr().Is4In6() {
		return netip.Prefix{}, &FieldError{Field: field, Value: s, Reason: "IPv4-mapped IPv6 prefixes are not supported"}
	}
	return p.Masked(), nil
}

// ParsePrefixList parses a comma-separated list of CIDRs (no wildcard).
func ParsePrefixList(field, s string) ([]netip.Prefix, error) {
	items := splitList(s)
	if len(items) > MaxListItems {
		return nil, &FieldError{Field: field, Value: s, Reason: fmt.Sprintf("more than %d prefixes", MaxListItems)}
	}
	var out []netip.Prefix
	seen := map[netip.Prefix]bool{}
	for _, it := range items {
		if it == "*" {
			return nil, &FieldError{Field: field, Value: s, Reason: "'*' is not allowed here"}
		}
		p, err := ParsePrefix(field, it)
		if err != nil {
			return nil, &FieldError{Field: field, Value: s, Reason: fmt.Sprintf("%q is not an IP address or CIDR", it)}
		}
		if !seen[p] {
			seen[p] = true
			out = append(out, p)
		}
	}
	return out, nil
}

// ParsePrefixSet parses "*" (everything), "" (nothing) or a CIDR list.
func ParsePrefixSet(field, s string) (PrefixSet, error) {
	if strings.TrimSpace(s) == "*" {
		return PrefixSet{All: true}, nil
	}
	ps, err := ParsePrefixList(field, s)
	if err != nil {
		return PrefixSet{}, err
	}
	return PrefixSet{Prefixes: ps}, nil
}

// ParseID parses a UID or GID (0 to 2^32-2; 4294967295 is the kernel's "no ID").
func ParseID(field, s string) (uint32, error) {
	n, err := strconv.ParseUint(strings.TrimSpace(s), 10, 32)
	if err != nil || n == 1<<32-1 {
		return 0, &FieldError{Field: field, Value: s, Reason: "a UID/GID must be a whole number from 0 to 4294967294"}
	}
	return uint32(n), nil
}

// ParseIDList parses a comma-separated list of UIDs or GIDs.
func ParseIDList(field, s string) ([]uint32, error) {
	items := splitList(s)
	if len(items) > MaxListItems {
		return nil, &FieldError{Field: field, Value: s, Reason: fmt.Sprintf("more than %d IDs", MaxListItems)}
	}
	var out []uint32
	seen := map[uint32]bool{}
	for _, it := range items {
		id, err := ParseID(field, it)
		if err != nil {
			return nil, &FieldError{Field: field, Value: s, Reason: fmt.Sprintf("%q: a UID/GID must be a whole number from 0 to 4294967294", it)}
		}
		if !seen[id] {
			seen[id] = true
			out = append(out, id)
		}
	}
	return out, nil
}

// ParseInterfaceList parses a comma-separated list of interface names.
func ParseInterfaceList(field, s string) ([]string, error) {
	items := splitList(s)
	if len(items) > MaxListItems {
		return nil, &FieldError{Field: field, Value: s, Reason: fmt.Sprintf("more than %d interfaces", MaxListItems)}
	}
	var out []string
	seen := map[string]bool{}
	for _, it := range items {
		if err := checkInterfaceName(it); err != nil {
			return nil, &FieldError{Field: field, Value: s, Reason: fmt.Sprintf("%q: %v", it, err)}
		}
		if !seen[it] {
			seen[it] = true
			out = append(out, it)
		}
	}
	return out, nil
}

// checkInterfaceName applies the kernel's rules (dev_valid_name) plus a conservative
// character set, so a name can never smuggle syntax into a rule.
func checkInterfaceName(name string) error {
	if name == "" || len(name) > maxIfaceName {
		return fmt.Errorf("an interface name has 1 to %d characters", maxIfaceName)
	}
	if name == "." || name == ".." {
		return fmt.Errorf("not a valid interface name")
	}
	for _, r := range name {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '-', r == '_', r == '.', r == '@':
		default:
			return fmt.Errorf("an interface name may only hold letters, digits and - _ . @")
		}
	}
	return nil
}

// ParseGroupList parses owner groups: numeric GIDs or group names.
func ParseGroupList(field, s string) ([]string, error) {
	items := splitList(s)
	if len(items) > MaxListItems {
		return nil, &FieldError{Field: field, Value: s, Reason: fmt.Sprintf("more than %d groups", MaxListItems)}
	}
	var out []string
	for _, it := range items {
		if it == "*" {
			continue // "*" means "all groups", the same as an empty list
		}
		if err := checkGroupName(it); err != nil {
			return nil, &FieldError{Field: field, Value: s, Reason: fmt.Sprintf("%q: %v", it, err)}
		}
		out = append(out, it)
	}
	return out, nil
}

func checkGroupName(g string) error {
	if g == "" || len(g) > maxGroupName {
		return fmt.Errorf("a group has 1 to %d characters", maxGroupName)
	}
	if _, err := strconv.ParseUint(g, 10, 32); err == nil {
		return nil
	}
	for i, r := range g {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r == '_':
		case (r >= '0' && r <= '9') || r == '-' || r == '.':
			if i == 0 {
				return fmt.Errorf("a group name starts with a letter or _")
			}
		default:
			return fmt.Errorf("a group is a GID or a name of letters, digits, -, _ and dots")
		}
	}
	return nil
}

// ParseMode parses the interception mode (case-insensitive; "" means REDIRECT).
func ParseMode(field, s string) (Mode, error) {
	switch strings.ToUpper(strings.TrimSpace(s)) {
	case "", "REDIRECT":
		return ModeRedirect, nil
	case "TPROXY":
		return ModeTProxy, nil
	}
	return "", &FieldError{Field: field, Value: s, Reason: "interception mode must be REDIRECT or TPROXY"}
}

// ParseBool parses Istio's boolean strings ("true", "false", "1", "0", case-insensitive).
func ParseBool(field, s string) (bool, error) {
	b, err := strconv.ParseBool(strings.TrimSpace(s))
	if err != nil {
		return false, &FieldError{Field: field, Value: s, Reason: "want true or false"}
	}
	return b, nil
}
