package engine

import (
	"context"
	"testing"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/backend"
	nftb "github.com/meshcni/meshcni/pkg/backend/nftables"
	"github.com/meshcni/meshcni/pkg/spec"
)

// TestApplyAutoListsTablesOnce: an auto Apply lists the namespace's nftables
// tables once, in its probe, and hands the listing to the nftables backend, whose
// Apply then sends its batch without listing again (the backend lists only over a
// socket of its own, TestApplyListed). Shown by the nfnetlink sockets the engine
// hands off (every one the engine or the backend opens): the probe's and the
// batch's, no third one for a listing, on a fresh namespace and on one already
// holding meshcni's tables; and by selectIn, which gives the nftables backend the
// probe's listing (empty but not nil on a fresh namespace), and an explicit
// backend none.
func TestApplyAutoListsTablesOnce(t *testing.T) {
	testutil.RequireRoot(t)
	s := spec.PodDefaults()
	ns := testutil.NewNetns(t)
	for _, round := range []string{"fresh netns", "tables present"} {
		var handed int
		o := Options{Backend: backend.Auto, NetnsPath: ns, HandOff: func(fds ...int) error { handed += len(fds); return nil }}
		k, err := Apply(context.Background(), o, &s)
		if err != nil || k != backend.Nftables {
			t.Fatalf("%s: apply: %s, %v", round, k, err)
		}
		if handed != 2 {
			t.Errorf("%s: %d nfnetlink sockets handed off, want 2 (the probe's, the batch's)", round, handed)
		}
	}
	fresh := testutil.NewNetns(t)
	for _, tc := range []struct {
		name   string
		kind   backend.Kind
		netns  string
		listed int // -1: no listing handed over
	}{
		{"auto, fresh netns", backend.Auto, fresh, 0},
		{"auto, tables present", backend.Auto, ns, 1}, // pod defaults: istio-proxy-nat only
		{"explicit", backend.Nftables, ns, -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, _, err := selectIn(tc.kind, tc.netns, nil)
			if err != nil {
				t.Fatal(err)
			}
			nb, ok := b.(*nftb.Backend)
			if !ok {
				t.Fatalf("selected %s, want nftables", b.Kind())
			}
			got := len(nb.Listed)
			if nb.Listed == nil {
				got = -1
			}
			if got != tc.listed {
				t.Errorf("listing handed over: %d tables (%v), want %d", got, nb.Listed, tc.listed)
			}
		})
	}
}
