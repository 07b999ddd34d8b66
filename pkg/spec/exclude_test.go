package spec_test

import (
	"reflect"
	"testing"

	"github.com/meshcni/meshcni/pkg/spec"
)

// TestParseExcludePortList: an exclusion list takes port 0 as Istio does — a rule
// that matches nothing — so "0" is accepted and excludes nothing, instead of failing
// the pod's ADD.
func TestParseExcludePortList(t *testing.T) {
	const f = "traffic.sidecar.istio.io/excludeOutboundPorts"
	for _, tc := range []struct {
		in   string
		want []uint16
		err  string
	}{
		{"0", nil, ""},
		{"0,80", []uint16{80}, ""},
		{"80, 0 ,443", []uint16{80, 443}, ""},
		{"", nil, ""},
		{"x", nil, `invalid ` + f + ` "x": "x": ` + portReason},
		{"70000", nil, `invalid ` + f + ` "70000": "70000": ` + portReason},
		{"*", nil, `invalid ` + f + ` "*": '*' is not allowed here`},
	} {
		got, err := spec.ParseExcludePortList(f, tc.in)
		if checkErr(t, err, f, tc.in, tc.err) && !reflect.DeepEqual(got, tc.want) {
			t.Errorf("ParseExcludePortList(%q) = %v, want %v", tc.in, got, tc.want)
		}
	}
}
