package spec

import (
	"errors"
	"net/netip"
	"strconv"
	"strings"
	"testing"
)

const fuzzField = "test/field"

// checkFieldErr fails unless err is a *FieldError naming fuzzField and the input.
func checkFieldErr(t *testing.T, fn string, err error, in string) {
	t.Helper()
	var fe *FieldError
	if !errors.As(err, &fe) {
		t.Fatalf("%s(%q): error %v is not a *FieldError", fn, in, err)
	}
	if fe.Field != fuzzField || fe.Value != in {
		t.Fatalf("%s(%q): error names field %q value %q, want %q %q", fn, in, fe.Field, fe.Value, fuzzField, in)
	}
}

func joinPorts(ps []uint16) string {
	s := make([]string, len(ps))
	for i, p := range ps {
		s[i] = strconv.Itoa(int(p))
	}
	return strings.Join(s, ",")
}

func checkPorts(t *testing.T, fn, in string, ps []uint16) {
	t.Helper()
	if len(ps) > MaxListItems {
		t.Fatalf("%s(%q): %d ports, more than %d", fn, in, len(ps), MaxListItems)
	}
	seen := map[uint16]bool{}
	for _, p := range ps {
		if p == 0 || seen[p] {
			t.Fatalf("%s(%q) = %v: port 0 or a duplicate", fn, in, ps)
		}
		seen[p] = true
	}
	again, err := ParsePortList(fuzzField, joinPorts(ps))
	if err != nil || joinPorts(again) != joinPorts(ps) {
		t.Fatalf("%s(%q) = %v does not round-trip: %v, %v", fn, in, ps, again, err)
	}
}

// FuzzParsePorts: accepted port lists hold 1-65535, no duplicates, at most
// MaxListItems, and round-trip; a rejected one is a *FieldError naming the field.
func FuzzParsePorts(f *testing.F) {
	for _, s := range []string{"", "*", "80", "80,443", " 15020 , 15021,", "0", "0,80", "65535", "65536", "-1", "+80", "0x50", "1e3", "80,*", "８０", "80\n-A X", strings.Repeat("1,", 300)} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		if p, err := ParsePort(fuzzField, in); err != nil {
			checkFieldErr(t, "ParsePort", err, in)
		} else if p == 0 || strconv.Itoa(int(p)) != strings.TrimLeft(strings.TrimSpace(in), "0") {
			t.Fatalf("ParsePort(%q) = %d", in, p)
		}
		if ps, err := ParsePortList(fuzzField, in); err != nil {
			checkFieldErr(t, "ParsePortList", err, in)
		} else {
			checkPorts(t, "ParsePortList", in, ps)
		}
		if ps, err := ParseExcludePortList(fuzzField, in); err != nil {
			checkFieldErr(t, "ParseExcludePortList", err, in)
		} else {
			checkPorts(t, "ParseExcludePortList", in, ps)
		}
		set, err := ParsePortSet(fuzzField, in)
		if err != nil {
			checkFieldErr(t, "ParsePortSet", err, in)
			return
		}
		if set.All != (strings.TrimSpace(in) == "*") || (set.All && len(set.Ports) > 0) {
			t.Fatalf("ParsePortSet(%q) = %+v", in, set)
		}
		checkPorts(t, "ParsePortSet", in, set.Ports)
	})
}

// FuzzParsePrefixes: accepted prefixes are valid, masked, never IPv4-mapped or zoned,
// unique, at most MaxListItems, and round-trip through their string form.
func FuzzParsePrefixes(f *testing.F) {
	for _, s := range []string{"", "*", "10.0.0.0/8", "10.1.2.3/8", "10.0.0.1", "fd00::/8, 10.0.0.0/8,", "::ffff:10.0.0.1", "::ffff:10.0.0.0/104", "fe80::1%eth0", "10.0.0.0/33", "10.0.0.0/-1", "10.0.0.0/8,*", "1.2.3.4/32\n", "0.0.0.0/0,::/0"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		ps, err := ParsePrefixList(fuzzField, in)
		if err != nil {
			checkFieldErr(t, "ParsePrefixList", err, in)
		}
		if len(ps) > MaxListItems {
			t.Fatalf("ParsePrefixList(%q): %d prefixes", in, len(ps))
		}
		seen := map[netip.Prefix]bool{}
		var strs []string
		for _, p := range ps {
			if !p.IsValid() || p != p.Masked() || p.Addr().Is4In6() || p.Addr().Zone() != "" || seen[p] {
				t.Fatalf("ParsePrefixList(%q) = %v: %v is invalid, unmasked, mapped, zoned or repeated", in, ps, p)
			}
			seen[p] = true
			strs = append(strs, p.String())
		}
		if err == nil {
			again, err := ParsePrefixList(fuzzField, strings.Join(strs, ","))
			if err != nil || len(again) != len(ps) {
				t.Fatalf("ParsePrefixList(%q) = %v does not round-trip: %v, %v", in, ps, again, err)
			}
			for i := range ps {
				if again[i] != ps[i] {
					t.Fatalf("ParsePrefixList(%q) = %v does not round-trip: %v", in, ps, again)
				}
			}
		}
		set, err := ParsePrefixSet(fuzzField, in)
		if err != nil {
			checkFieldErr(t, "ParsePrefixSet", err, in)
		} else if set.All != (strings.TrimSpace(in) == "*") || (set.All && len(set.Prefixes) > 0) {
			t.Fatalf("ParsePrefixSet(%q) = %+v", in, set)
		}
	})
}

// safeName reports whether s holds only the characters interface and group names may
// hold: nothing a rule's syntax could read as a separator, quote or comment.
func safeName(s string) bool {
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("-_.@", r)) {
			return false
		}
	}
	return s != ""
}

// FuzzParseNames: accepted interface names are 1-15 safe characters (no space, quote,
// newline or comma), never "." or ".."; group names are GIDs or safe names of at most
// 32 characters; IDs are never 4294967295; all lists round-trip.
func FuzzParseNames(f *testing.F) {
	for _, s := range []string{"", "eth0", "eth0,eth1, net1 ,", "*", ".", "..", "a.b@c_d-e", "0123456789abcdef", "eth0\n-A OUTPUT -j ACCEPT", "eth0 -j", "eth\"0", "ëth0", "1337", "1337,1338", "4294967295", "4294967294", "-1", "istio-proxy", "_grp", "1grp", "*,wheel"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		ifs, err := ParseInterfaceList(fuzzField, in)
		if err != nil {
			checkFieldErr(t, "ParseInterfaceList", err, in)
		} else {
			if len(ifs) > MaxListItems {
				t.Fatalf("ParseInterfaceList(%q): %d names", in, len(ifs))
			}
			for _, n := range ifs {
				if !safeName(n) || len(n) > 15 || n == "." || n == ".." {
					t.Fatalf("ParseInterfaceList(%q) accepted %q", in, n)
				}
			}
			again, err := ParseInterfaceList(fuzzField, strings.Join(ifs, ","))
			if err != nil || strings.Join(again, ",") != strings.Join(ifs, ",") {
				t.Fatalf("ParseInterfaceList(%q) = %q does not round-trip: %q, %v", in, ifs, again, err)
			}
		}
		groups, err := ParseGroupList(fuzzField, in)
		if err != nil {
			checkFieldErr(t, "ParseGroupList", err, in)
		}
		for _, g := range groups {
			if !safeName(g) || len(g) > 32 || strings.ContainsAny(g, "@") {
				t.Fatalf("ParseGroupList(%q) accepted %q", in, g)
			}
		}
		ids, err := ParseIDList(fuzzField, in)
		if err != nil {
			checkFieldErr(t, "ParseIDList", err, in)
			return
		}
		var strs []string
		for _, id := range ids {
			if id == 1<<32-1 {
				t.Fatalf("ParseIDList(%q) accepted 4294967295", in)
			}
			strs = append(strs, strconv.FormatUint(uint64(id), 10))
		}
		if again, err := ParseIDList(fuzzField, strings.Join(strs, ",")); err != nil || len(again) != len(ids) {
			t.Fatalf("ParseIDList(%q) = %v does not round-trip: %v, %v", in, ids, again, err)
		}
	})
}

// FuzzParseModeBool: a mode is REDIRECT or TPROXY, or a *FieldError; ParseBool agrees
// with strconv.ParseBool on the trimmed value.
func FuzzParseModeBool(f *testing.F) {
	for _, s := range []string{"", "REDIRECT", "tproxy", " TProxy ", "NONE", "true", "0", "T", "yes"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		m, err := ParseMode(fuzzField, in)
		if err != nil {
			checkFieldErr(t, "ParseMode", err, in)
		} else if m != ModeRedirect && m != ModeTProxy {
			t.Fatalf("ParseMode(%q) = %q", in, m)
		}
		b, err := ParseBool(fuzzField, in)
		want, werr := strconv.ParseBool(strings.TrimSpace(in))
		if (err == nil) != (werr == nil) || b != want {
			t.Fatalf("ParseBool(%q) = %v, %v; strconv says %v, %v", in, b, err, want, werr)
		}
		if err != nil {
			checkFieldErr(t, "ParseBool", err, in)
		}
	})
}
