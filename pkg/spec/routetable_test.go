package spec

import (
	"errors"
	"testing"
)

// TestUsableRouteTable: 0 and the kernel's 252-255 are refused, 1-251 and 256 up
// taken; Validate refuses exactly the refused ones, naming the table.
func TestUsableRouteTable(t *testing.T) {
	for _, tc := range []struct {
		table uint32
		ok    bool
	}{{0, false}, {1, true}, {133, true}, {251, true}, {252, false}, {253, false}, {254, false}, {255, false}, {256, true}, {1 << 31, true}, {^uint32(0), true}} {
		if got := UsableRouteTable(tc.table); got != tc.ok {
			t.Errorf("UsableRouteTable(%d) = %v, want %v", tc.table, got, tc.ok)
		}
		s := Default()
		s.TProxyRouteTable = tc.table
		err := s.Validate()
		var fe *FieldError
		switch {
		case tc.ok && err != nil:
			t.Errorf("Validate with route table %d = %v, want nil", tc.table, err)
		case !tc.ok && (!errors.As(err, &fe) || fe.Field != "TPROXY route table" || fe.Reason != "route tables 0 and 252-255 are reserved"):
			t.Errorf("Validate with route table %d = %v, want the reserved-table error", tc.table, err)
		}
	}
}
