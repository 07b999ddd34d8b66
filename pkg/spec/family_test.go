package spec_test

import (
	"errors"
	"net/netip"
	"testing"

	"github.com/meshcni/meshcni/pkg/spec"
)

func TestParseIPv6Mode(t *testing.T) {
	for _, tc := range []struct {
		in      string
		want    spec.IPv6Mode
		wantErr string
	}{
		{"istio", spec.IPv6Istio, ""},
		{"capture", spec.IPv6Capture, ""},
		{"drop", spec.IPv6Drop, ""},
		{" Drop ", spec.IPv6Drop, ""},
		{"CAPTURE", spec.IPv6Capture, ""},
		{"", "", `invalid meshcni.io/ipv6 "": want istio, capture or drop`},
		{"pass", "", `invalid meshcni.io/ipv6 "pass": want istio, capture or drop`},
		{"true", "", `invalid meshcni.io/ipv6 "true": want istio, capture or drop`},
		{"drop,capture", "", `invalid meshcni.io/ipv6 "drop,capture": want istio, capture or drop`},
	} {
		t.Run(tc.in, func(t *testing.T) {
			got, err := spec.ParseIPv6Mode("meshcni.io/ipv6", tc.in)
			if tc.wantErr != "" {
				var fe *spec.FieldError
				if !errors.As(err, &fe) || err.Error() != tc.wantErr {
					t.Fatalf("err = %v, want *FieldError %q", err, tc.wantErr)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("= %q, %v; want %q", got, err, tc.want)
			}
		})
	}
}

// TestIstioIPv6: Istio's getLocalIP (tools/common/config/config.go) walks the pod's
// addresses, IPv4 first, skipping loopback and link-local ones; without DUAL_STACK
// the first one left decides, with it any IPv6 address does.
func TestIstioIPv6(t *testing.T) {
	a := func(ss ...string) []netip.Addr {
		var out []netip.Addr
		for _, s := range ss {
			out = append(out, netip.MustParseAddr(s))
		}
		return out
	}
	for _, tc := range []struct {
		name      string
		dualStack bool
		addrs     []netip.Addr
		want      bool
	}{
		{"IPv4 only", false, a("10.1.0.5"), false},
		{"IPv4 only, dual stack", true, a("10.1.0.5"), false},
		{"dual-stack pod, single-stack proxy", false, a("10.1.0.5", "fd00::5"), false},
		{"dual-stack pod, IPv6 first in the list", false, a("fd00::5", "10.1.0.5"), false},
		{"dual-stack pod, dual-stack proxy", true, a("10.1.0.5", "fd00::5"), true},
		{"IPv6-only pod", false, a("fd00::5"), true},
		{"IPv6-only pod, dual stack", true, a("fd00::5"), true},
		{"IPv4 and only link-local IPv6", true, a("10.1.0.5", "fe80::1"), false},
		{"loopback and link-local only", false, a("127.0.0.1", "::1", "fe80::1", "169.254.1.1"), false},
		{"IPv4-mapped IPv6 is IPv4", false, a("::ffff:10.1.0.5", "fd00::5"), false},
		{"no address", true, nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := spec.IstioIPv6(tc.dualStack, tc.addrs); got != tc.want {
				t.Errorf("IstioIPv6(%v, %v) = %v, want %v", tc.dualStack, tc.addrs, got, tc.want)
			}
		})
	}
}

func TestIPv6Captured(t *testing.T) {
	for _, tc := range []struct {
		enable bool
		mode   spec.IPv6Mode
		want   bool
	}{
		{false, spec.IPv6Istio, false}, {true, spec.IPv6Istio, true},
		{false, spec.IPv6Capture, true}, {true, spec.IPv6Capture, true},
		{false, spec.IPv6Drop, false}, {true, spec.IPv6Drop, true},
	} {
		s := spec.PodDefaults()
		s.EnableIPv6, s.IPv6 = tc.enable, tc.mode
		if got := s.IPv6Captured(); got != tc.want {
			t.Errorf("EnableIPv6 %v, mode %s: IPv6Captured() = %v, want %v", tc.enable, tc.mode, got, tc.want)
		}
	}
}
