package nfttest

import (
	"maps"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/meshcni/meshcni/internal/testkit/conformance"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/rules"
)

// Conformance runs every Istio nftables case (../shared/conformance/istio): load
// puts meshcni's ruleset for the case into a fresh namespace, Istio's golden is
// loaded with nft into another, and both kernels' rules must be equal per table and
// chain, order kept. known lists the cases that differ on purpose, with the reason
// (docs/conformance.md); a known case that turns out equal fails, so the list stays
// true. what names the path under test in the summary line.
func Conformance(t *testing.T, what string, known map[string]string, load func(t *testing.T, netnsPath string, rs *rules.Ruleset)) {
	Require(t)
	cases := conformance.Cases(t, "nftables")
	conformance.EnsureGroups(t, "java", "ftp")
	equal := 0
	for _, c := range cases {
		t.Run(c.Name, func(t *testing.T) {
			s, err := c.Spec()
			if err != nil {
				t.Fatal(err)
			}
			golden, err := os.ReadFile(c.Golden("nftables"))
			if err != nil {
				t.Fatal(err)
			}
			mine, theirs := testutil.NewNetns(t), testutil.NewNetns(t)
			load(t, mine, rules.Build(s))
			Load(t, theirs, Golden(string(golden)))
			d := Diff(Parse(List(t, theirs)), Parse(List(t, mine)))
			if why, ok := known[c.Name]; ok {
				if d == "" {
					t.Errorf("listed as a known difference (%s) but equal: remove it from the list", why)
				} else {
					t.Logf("known difference: %s\n%s", why, d)
				}
				return
			}
			if d != "" {
				t.Errorf("kernel state differs from Istio's:\n%s", d)
				return
			}
			equal++
		})
	}
	t.Logf("%s equals Istio's golden for %d/%d cases (%d known differences: %s)",
		what, equal, len(cases), len(known), strings.Join(slices.Sorted(maps.Keys(known)), ", "))
}
