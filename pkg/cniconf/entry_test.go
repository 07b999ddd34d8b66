package cniconf

import (
	"regexp"
	"strings"
	"testing"
)

// IsNamespaceName replaced a regexp: it must agree with it (and the 63-byte limit) on
// every input, edge cases included.
func TestIsNamespaceName(t *testing.T) {
	re := regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`)
	for _, tc := range []struct {
		s    string
		want bool
	}{
		{"", false},
		{"a", true},
		{"0", true},
		{"-", false},
		{"kube-system", true},
		{"a-b-c", true},
		{"a--b", true},
		{"-a", false},
		{"a-", false},
		{"Kube_System", false},
		{"kube_system", false},
		{"kube.system", false},
		{"A", false},
		{"a\n", false},
		{"\na", false},
		{"a b", false},
		{"ä", false},
		{"a\x00", false},
		{strings.Repeat("a", 63), true},
		{strings.Repeat("a", 64), false},
		{"a" + strings.Repeat("-", 61) + "z", true},
	} {
		if got := IsNamespaceName(tc.s); got != tc.want {
			t.Errorf("IsNamespaceName(%q) = %v, want %v", tc.s, got, tc.want)
		}
		if ref := len(tc.s) <= 63 && re.MatchString(tc.s); ref != tc.want {
			t.Errorf("table entry %q: regexp says %v, table %v", tc.s, ref, tc.want)
		}
	}
	// Every string of length ≤ 3 over an alphabet with each character class.
	alphabet := []byte("az09-_A.\n")
	var walk func(prefix []byte)
	walk = func(prefix []byte) {
		s := string(prefix)
		if got, want := IsNamespaceName(s), re.MatchString(s); got != want {
			t.Errorf("IsNamespaceName(%q) = %v, regexp %v", s, got, want)
		}
		if len(prefix) == 3 {
			return
		}
		for _, c := range alphabet {
			walk(append(prefix, c))
		}
	}
	walk(nil)
}
