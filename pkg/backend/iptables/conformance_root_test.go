package iptables

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/meshcni/meshcni/internal/testkit/conformance"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/rules"
)

// goldenInputs splits an Istio iptables golden file into restore inputs for IPv4
// and IPv6 (the IPv6 blocks start where a table name repeats).
func goldenInputs(golden string) (v4, v6 string) {
	seen := map[string]bool{}
	var b4, b6 strings.Builder
	cur := &b4
	for _, line := range strings.Split(golden, "\n") {
		switch {
		case line == "iptables-save" || line == "ip6tables-save" || line == "":
			continue
		case strings.HasPrefix(line, "* "), strings.HasPrefix(line, "*"):
			name := strings.TrimSpace(strings.TrimPrefix(line, "*"))
			if seen[name] {
				cur = &b6
				seen = map[string]bool{}
			}
			seen[name] = true
			line = "*" + name
		}
		cur.WriteString(line + "\n")
	}
	return b4.String(), b6.String()
}

// TestConformance loads meshcni's rules (through this backend) and Istio's golden
// rules into two fresh namespaces per case and flavor, and compares what the kernel
// reads back, per table and chain, in order, counters dropped.
func TestConformance(t *testing.T) {
	testutil.RequireRoot(t)
	conformance.EnsureGroups(t, "java", "ftp")
	cases := conformance.Cases(t, "iptables")
	for _, kind := range []backend.Kind{backend.IptablesNft, backend.IptablesLegacy} {
		b, err := New(kind)
		if err != nil {
			t.Fatal(err)
		}
		testutil.RequireBinary(t, strings.Replace(string(kind), "iptables-", "iptables-", 1)+"-restore")
		equal := 0
		for _, c := range cases {
			t.Run(fmt.Sprintf("%s/%s", kind, c.Name), func(t *testing.T) {
				s, err := c.Spec()
				if err != nil {
					t.Fatal(err)
				}
				ctx := context.Background()
				ours, theirs := testutil.NewNetns(t), testutil.NewNetns(t)
				if err := b.Apply(ctx, ours, rules.Build(s)); err != nil {
					t.Fatalf("apply: %v", err)
				}
				g4, g6 := goldenInputs(readFile(t, c.Golden("iptables")))
				for fam, in := range map[rules.Family]string{rules.V4: g4, rules.V6: g6} {
					if in == "" {
						continue
					}
					if _, err := b.run(ctx, theirs, fam, "-restore", in, "--noflush"); err != nil {
						t.Fatalf("load golden %s: %v", fam, err)
					}
				}
				ok := true
				for _, fam := range []rules.Family{rules.V4, rules.V6} {
					got := save(t, b, ours, fam)
					want := save(t, b, theirs, fam)
					if got != want {
						ok = false
						t.Errorf("%s differs:\n--- meshcni\n%s--- istio\n%s", fam, got, want)
					}
				}
				if ok {
					equal++
				}
			})
		}
		t.Logf("iptables conformance (%s): %d/%d cases equal to Istio", kind, equal, len(cases))
	}
}

func save(t *testing.T, b *Backend, netns string, fam rules.Family) string {
	t.Helper()
	out, err := b.Save(context.Background(), netns, fam)
	if err != nil {
		t.Fatalf("save %s: %v", fam, err)
	}
	return Normalize(out)
}
