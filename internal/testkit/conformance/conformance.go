// Package conformance reads the Istio conformance cases in ../shared/conformance/istio
// (see its README) and turns each case's inputs into a meshcni spec, for the
// iptables and nftables conformance tests.
package conformance

import (
	"bufio"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/istioflags"
	"github.com/meshcni/meshcni/pkg/spec"
)

// BaseFlags are the istio-iptables flags every case starts from.
var BaseFlags = []string{"-p", "15001", "-z", "15006", "-e", "15008", "-u", "1337", "-g", "1337", "-t", "1337", "-r", "133"}

// Case is one conformance case.
type Case struct {
	Name        string
	PodV6       bool // the pod has an IPv6 address (Istio then writes IPv6 rules too)
	Nameservers []netip.Addr
	Env         map[string]string
	Flags       []string // BaseFlags + the case's extra flags
	Suites      string   // "both" or "nftables"
	Dir         string   // the conformance/istio directory
}

// Golden returns the path of the case's golden file for "iptables" or "nftables".
func (c Case) Golden(suite string) string {
	return filepath.Join(c.Dir, suite, c.Name+".golden")
}

// Spec builds the meshcni spec for the case, as istio-iptables would see it.
func (c Case) Spec() (*spec.Spec, error) {
	s, err := istioflags.Parse(c.Flags, func(k string) string { return c.Env[k] })
	if err != nil {
		return nil, fmt.Errorf("case %s: %w", c.Name, err)
	}
	s.EnableIPv6 = c.PodV6
	for _, a := range c.Nameservers {
		if a.Is4() {
			s.DNSServersV4 = append(s.DNSServersV4, a)
		} else {
			s.DNSServersV6 = append(s.DNSServersV6, a)
		}
	}
	return s, s.Validate()
}

// Cases loads every case of the suite ("iptables" or "nftables").
func Cases(t testing.TB, suite string) []Case {
	t.Helper()
	dir := testutil.SharedDir(t, "conformance/istio")
	cs, err := Load(dir)
	if err != nil {
		t.Fatalf("load conformance cases: %v", err)
	}
	var out []Case
	for _, c := range cs {
		if c.Suites == "both" || c.Suites == suite {
			out = append(out, c)
		}
	}
	return out
}

// Load parses cases.tsv in dir.
func Load(dir string) ([]Case, error) {
	f, err := os.Open(filepath.Join(dir, "cases.tsv"))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []Case
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if strings.HasPrefix(line, "#") || strings.TrimSpace(line) == "" {
			continue
		}
		cols := strings.Split(line, "\t")
		if len(cols) != 6 {
			return nil, fmt.Errorf("cases.tsv:%d: want 6 columns, got %d", n, len(cols))
		}
		c := Case{Name: cols[0], PodV6: cols[1] == "v6", Env: map[string]string{}, Suites: cols[5], Dir: dir}
		if cols[2] != "-" {
			for _, s := range strings.Split(cols[2], ",") {
				a, err := netip.ParseAddr(s)
				if err != nil {
					return nil, fmt.Errorf("cases.tsv:%d: nameserver %q: %w", n, s, err)
				}
				c.Nameservers = append(c.Nameservers, a)
			}
		}
		if cols[3] != "-" {
			for _, kv := range strings.Fields(cols[3]) {
				k, v, ok := strings.Cut(kv, "=")
				if !ok {
					return nil, fmt.Errorf("cases.tsv:%d: env %q", n, kv)
				}
				c.Env[k] = v
			}
		}
		c.Flags = append([]string(nil), BaseFlags...)
		if cols[4] != "-" {
			words, err := splitWords(cols[4])
			if err != nil {
				return nil, fmt.Errorf("cases.tsv:%d: %w", n, err)
			}
			c.Flags = append(c.Flags, words...)
		}
		out = append(out, c)
	}
	return out, sc.Err()
}

// splitWords splits a command line with single quotes, as the cases write them
// (`-b '*'`, `-m ”`).
func splitWords(s string) ([]string, error) {
	var out []string
	var cur strings.Builder
	inWord, quoted := false, false
	for _, r := range s {
		switch {
		case quoted && r == '\'':
			quoted = false
		case quoted:
			cur.WriteRune(r)
		case r == '\'':
			quoted, inWord = true, true
		case r == ' ' || r == '\t':
			if inWord {
				out = append(out, cur.String())
				cur.Reset()
				inWord = false
			}
		default:
			cur.WriteRune(r)
			inWord = true
		}
	}
	if quoted {
		return nil, fmt.Errorf("unterminated quote in %q", s)
	}
	if inWord {
		out = append(out, cur.String())
	}
	return out, nil
}

// EnsureGroups makes sure the group names the cases use resolve (iptables-restore
// and nft look them up), adding the missing ones with groupadd --system. They are
// left in place: test binaries of several packages run at once and rely on them, so
// removing them when one finishes would break another mid-test.
func EnsureGroups(t testing.TB, names ...string) {
	t.Helper()
	data, _ := os.ReadFile("/etc/group")
	have := map[string]bool{}
	for _, l := range strings.Split(string(data), "\n") {
		if n, _, ok := strings.Cut(l, ":"); ok {
			have[n] = true
		}
	}
	for _, n := range names {
		if have[n] {
			continue
		}
		groupadd := testutil.RequireBinary(t, "groupadd")
		// -f: succeed if a concurrent test binary added it meanwhile.
		if out, err := runCmd(groupadd, "--system", "-f", n); err != nil {
			t.Fatalf("groupadd %s: %v: %s", n, err, out)
		}
	}
}
