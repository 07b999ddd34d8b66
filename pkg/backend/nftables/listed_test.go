package nftables_test

import (
	"context"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/internal/testkit/nfttest"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/backend/nftables"
	"github.com/meshcni/meshcni/pkg/netlink"
	"github.com/meshcni/meshcni/pkg/rules/nft"
)

// TestApplyListed: given the caller's table listing (Backend.Listed, as pkg/engine
// hands it over), Apply opens one netlink socket, its batch's, and lists nothing;
// without it, Apply lists the tables over a socket of its own first. A listing that
// misses a table present in the namespace (one created since) fails the first batch
// (the exclusive create), and Apply lists again and replaces it; a listing that
// names tables now absent only adds and deletes them. Each ends with the ruleset
// that a plain Apply leaves.
func TestApplyListed(t *testing.T) {
	nfttest.Require(t)
	ctx := context.Background()
	rs := build(t, podDefaults())
	plain := testutil.NewNetns(t)
	if err := nftables.New().Apply(ctx, plain, rs); err != nil {
		t.Fatal(err)
	}
	want := nfttest.Normalize(nfttest.List(t, plain))
	var ours []netlink.Table
	for _, m := range nft.Tables {
		ours = append(ours, netlink.Table{Family: unix.NFPROTO_INET, Name: nft.TableName(m)})
	}
	for _, tt := range []struct {
		name    string
		applied bool            // the namespace holds meshcni's tables before the Apply
		listed  []netlink.Table // nil: none handed over
		sockets int             // sockets Apply opens
	}{
		{"no listing, fresh netns", false, nil, 2},
		{"no listing, tables present", true, nil, 2},
		{"listing, fresh netns", false, []netlink.Table{}, 1},
		{"listing, tables present", true, ours, 1},
		{"stale listing misses present tables", true, []netlink.Table{}, 2},
		{"stale listing names absent tables", false, ours, 1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ns := testutil.NewNetns(t)
			if tt.applied {
				if err := nftables.New().Apply(ctx, ns, rs); err != nil {
					t.Fatal(err)
				}
			}
			b := nftables.New()
			var fds []int
			b.OnSocket = func(fd int) { fds = append(fds, fd) }
			b.Listed = tt.listed
			if err := b.Apply(ctx, ns, rs); err != nil {
				t.Fatal(err)
			}
			if len(fds) != tt.sockets {
				t.Errorf("Apply opened %d netlink sockets, want %d", len(fds), tt.sockets)
			}
			if b.Listed != nil {
				t.Errorf("Apply left Listed set: %v", b.Listed)
			}
			if got := nfttest.Normalize(nfttest.List(t, ns)); got != want {
				t.Errorf("ruleset:\n%s\n--- want\n%s", got, want)
			}
		})
	}
}
