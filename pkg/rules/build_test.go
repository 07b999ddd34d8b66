package rules

import (
	"net/netip"
	"testing"
)

// The fixed prefixes are built from bytes: they must be the parsed ones.
func TestFixedPrefixes(t *testing.T) {
	for _, tc := range []struct {
		got  netip.Prefix
		want string
	}{
		{v6Loopback, "::1/128"},
		{v4Passthru, "127.0.0.6/32"},
		{v6Passthru, "::6/128"},
	} {
		if want := netip.MustParsePrefix(tc.want); tc.got != want {
			t.Errorf("%v (%#v), want %v (%#v)", tc.got, tc.got, want, want)
		}
	}
}
