package conformance

import (
	"testing"

	"github.com/meshcni/meshcni/pkg/rules"
)

func TestCasesParse(t *testing.T) {
	for _, suite := range []string{"iptables", "nftables"} {
		cs := Cases(t, suite)
		want := map[string]int{"iptables": 27, "nftables": 28}[suite]
		if len(cs) != want {
			t.Fatalf("%s: %d cases, want %d", suite, len(cs), want)
		}
		for _, c := range cs {
			s, err := c.Spec()
			if err != nil {
				t.Errorf("%s: %v", c.Name, err)
				continue
			}
			if rs := rules.Build(s); len(rs.Tables) == 0 {
				t.Errorf("%s: empty ruleset", c.Name)
			}
		}
	}
}

func TestSplitWords(t *testing.T) {
	for in, want := range map[string][]string{
		"-b '*' -m ''":     {"-b", "*", "-m", ""},
		"-x 1.1.0.0/16 -i": {"-x", "1.1.0.0/16", "-i"},
	} {
		got, err := splitWords(in)
		if err != nil || len(got) != len(want) {
			t.Fatalf("%q: %q %v", in, got, err)
		}
		for i := range got {
			if got[i] != want[i] {
				t.Errorf("%q: word %d = %q, want %q", in, i, got[i], want[i])
			}
		}
	}
}
