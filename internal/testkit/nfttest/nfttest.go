// Package nfttest holds test helpers for meshcni's nftables code: running `nft` inside
// a network namespace and reading a ruleset back in a comparable form (counters and
// handles dropped). It executes programs and is meant for tests only.
package nfttest

import (
	"bytes"
	"fmt"
	"os/exec"
	"regexp"
	"sort"
	"strings"
	"testing"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
)

// Run runs `nft args...` inside the namespace at netnsPath, with stdin.
func Run(netnsPath, stdin string, args ...string) (string, error) {
	nsenter, err := exec.LookPath("nsenter")
	if err != nil {
		return "", err
	}
	cmd := exec.Command(nsenter, append([]string{"--net=" + netnsPath, "nft"}, args...)...)
	cmd.Stdin = strings.NewReader(stdin)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("nft %s: %w: %s", strings.Join(args, " "), err, errb.String())
	}
	return out.String(), nil
}

// Require skips (or fails under CI) unless root, nft and nsenter are available.
func Require(t testing.TB) {
	t.Helper()
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "nft")
	testutil.RequireBinary(t, "nsenter")
}

// Load runs an `nft -f -` script in the namespace.
func Load(t testing.TB, netnsPath, script string) {
	t.Helper()
	if _, err := Run(netnsPath, script, "-f", "-"); err != nil {
		t.Fatalf("load script: %v\n%s", err, script)
	}
}

// List returns `nft list ruleset` of the namespace, verbatim.
func List(t testing.TB, netnsPath string) string {
	t.Helper()
	out, err := Run(netnsPath, "", "list", "ruleset")
	if err != nil {
		t.Fatalf("list ruleset: %v", err)
	}
	return out
}

var (
	counterRe = regexp.MustCompile(`counter packets \d+ bytes \d+`)
	handleRe  = regexp.MustCompile(` # handle \d+`)
)

// Normalize drops counter values and handles from `nft list` output.
func Normalize(s string) string {
	s = counterRe.ReplaceAllString(s, "counter")
	return handleRe.ReplaceAllString(s, "")
}

// Ruleset is a listed ruleset: table ("inet istio-proxy-nat") → chain → the chain's
// lines (its base chain declaration first, if any, then its rules), in order.
type Ruleset map[string]map[string][]string

// Parse reads `nft list ruleset` output (normalized) into a Ruleset.
func Parse(listing string) Ruleset {
	rs := Ruleset{}
	var table, chain string
	for _, line := range strings.Split(Normalize(listing), "\n") {
		l := strings.TrimSpace(line)
		switch {
		case l == "" || l == "}":
			if l == "}" {
				if chain != "" {
					chain = ""
				} else {
					table = ""
				}
			}
		case strings.HasPrefix(l, "table "):
			table = strings.TrimSuffix(strings.TrimPrefix(l, "table "), " {")
			rs[table] = map[string][]string{}
		case strings.HasPrefix(l, "chain ") && table != "":
			chain = strings.TrimSuffix(strings.TrimPrefix(l, "chain "), " {")
			rs[table][chain] = []string{}
		case chain != "":
			rs[table][chain] = append(rs[table][chain], l)
		}
	}
	return rs
}

// Diff compares two parsed rulesets per table and chain, order kept inside each
// chain, and describes the differences ("" when equal).
func Diff(want, got Ruleset) string {
	var sb strings.Builder
	tables := map[string]bool{}
	for t := range want {
		tables[t] = true
	}
	for t := range got {
		tables[t] = true
	}
	for _, t := range sortedKeys(tables) {
		wc, gc := want[t], got[t]
		if wc == nil || gc == nil {
			fmt.Fprintf(&sb, "table %s: want present=%v, got present=%v\n", t, wc != nil, gc != nil)
			continue
		}
		chains := map[string]bool{}
		for c := range wc {
			chains[c] = true
		}
		for c := range gc {
			chains[c] = true
		}
		for _, c := range sortedKeys(chains) {
			w, g := wc[c], gc[c]
			if w == nil || g == nil {
				fmt.Fprintf(&sb, "%s chain %s: want present=%v, got present=%v\n", t, c, w != nil, g != nil)
				continue
			}
			if strings.Join(w, "\n") != strings.Join(g, "\n") {
				fmt.Fprintf(&sb, "%s chain %s:\n  want:\n    %s\n  got:\n    %s\n", t, c, strings.Join(w, "\n    "), strings.Join(g, "\n    "))
			}
		}
	}
	return sb.String()
}

func sortedKeys(m map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// Golden turns an Istio nftables golden file into an `nft -f` script: one command a
// line; the iptables-save/ip6tables-save probe lines are skipped.
func Golden(data string) string {
	var sb strings.Builder
	for _, l := range strings.Split(data, "\n") {
		l = strings.TrimSpace(l)
		if l == "" || l == "iptables-save" || l == "ip6tables-save" {
			continue
		}
		sb.WriteString(l + "\n")
	}
	return sb.String()
}
