package nftables_test

import (
	"errors"
	"slices"
	"strings"
	"testing"

	gnft "github.com/google/nftables"
	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/backend/nftables"
	"github.com/meshcni/meshcni/pkg/netlink"
	"github.com/meshcni/meshcni/pkg/netlink/nltest"
	"github.com/meshcni/meshcni/pkg/netnsutil"
)

// TestProbeTablesRetry: a table dump (netlink.ListTables, as the probe and Clean run it) the kernel flags interrupted is run again
// from scratch (what the interrupted attempt listed is dropped), up to three
// times; a dump interrupted every time is an error, and a dump that fails part-way
// (an error in its done message) is that error.
func TestProbeTablesRetry(t *testing.T) {
	ours := nftTableName(t)
	for _, tc := range []struct {
		name        string
		interrupted int        // attempts flagged NLM_F_DUMP_INTR
		doneErr     unix.Errno // the done message's error (every attempt)
		wantTries   int
		wantErr     error
		wantOurs    int
	}{
		{"consistent", 0, 0, 1, nil, 0},
		{"interrupted once", 1, 0, 2, nil, 0},
		{"interrupted twice", 2, 0, 3, nil, 0},
		{"interrupted every time", 3, 0, 3, netlink.ErrDumpInterrupted, 1},
		{"fails part-way", 0, unix.ENOBUFS, 1, unix.ENOBUFS, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			peer, fd, port := nltest.New(t, func(r nltest.Req) [][]byte {
				if r.Typ != netlink.NfMsg(unix.NFT_MSG_GETTABLE) {
					return [][]byte{nltest.Msg(unix.NLMSG_ERROR, 0, r.Seq, nltest.Errno(unix.EINVAL), false)}
				}
				if r.N < tc.interrupted {
					// While it was dumped, meshcni's table went away.
					return [][]byte{nltest.Cat(nltest.NfTable(r.Seq, unix.NLM_F_DUMP_INTR, unix.NFPROTO_INET, ours), nltest.Done(r.Seq))}
				}
				done := nltest.Msg(unix.NLMSG_DONE, unix.NLM_F_MULTI, r.Seq, nltest.Errno(tc.doneErr), false)
				if tc.doneErr != 0 {
					return [][]byte{nltest.Cat(nltest.NfTable(r.Seq, 0, unix.NFPROTO_INET, ours), done)}
				}
				return [][]byte{nltest.Cat(nltest.NfTable(r.Seq, 0, unix.NFPROTO_INET, "foreign"), done)}
			})
			listed, err := netlink.ListTables(netlink.NewConn(fd, port))
			if tc.wantErr == nil && err != nil || tc.wantErr != nil && !errors.Is(err, tc.wantErr) {
				t.Fatalf("ListTables = %v, want %v", err, tc.wantErr)
			}
			if ours := nftables.Ours(listed); len(ours) != tc.wantOurs {
				t.Errorf("found our tables %v, want %d", ours, tc.wantOurs)
			}
			if got := len(peer.Requests()); got != tc.wantTries {
				t.Errorf("%d dump requests, want %d", got, tc.wantTries)
			}
		})
	}
}

// nftTableName is the name of one of meshcni's nftables tables.
func nftTableName(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"istio-proxy-nat", "istio-proxy-mangle"} {
		if len(nftables.Ours([]netlink.Table{{Family: unix.NFPROTO_INET, Name: name}})) == 1 {
			return name
		}
	}
	t.Fatal("no known meshcni table name")
	return ""
}

// TestDeleteTablesGone: deleting a table that does not exist fails the batch with
// ENOENT naming the table, without waiting for answers that never come, and the
// socket stays usable.
func TestDeleteTablesGone(t *testing.T) {
	testutil.RequireRoot(t)
	netns := testutil.NewNetns(t)
	addForeignTable(t, netns, gnft.TableFamilyINet, "foreign", "keep")
	var c *netlink.Conn
	if err := netnsutil.Do(netns, func() (err error) { c, err = netlink.Open(unix.NETLINK_NETFILTER); return err }); err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	err := netlink.DeleteTables(c, []netlink.Table{{Family: unix.NFPROTO_INET, Name: "foreign"}, {Family: unix.NFPROTO_INET, Name: "meshcni-none"}})
	if !errors.Is(err, unix.ENOENT) || !strings.Contains(err.Error(), "meshcni-none") {
		t.Fatalf("DeleteTables = %v, want ENOENT naming meshcni-none", err)
	}
	if names := tableNames(t, netns); !slices.Equal(names, []string{"inet foreign"}) {
		t.Fatalf("tables after a failed batch: %v, want the foreign one kept (all or nothing)", names)
	}
	if err := netlink.DeleteTables(c, []netlink.Table{{Family: unix.NFPROTO_INET, Name: "foreign"}}); err != nil {
		t.Fatalf("delete on the same socket: %v", err)
	}
	if names := tableNames(t, netns); len(names) != 0 {
		t.Fatalf("tables after delete: %v", names)
	}
}

// addForeignTable creates a table (with one regular chain) that is not meshcni's.
func addForeignTable(t testing.TB, netns string, fam gnft.TableFamily, name, chain string) {
	t.Helper()
	conn, closeConn, err := nftables.Dial(netns, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer closeConn()
	tb := conn.AddTable(&gnft.Table{Family: fam, Name: name})
	conn.AddChain(&gnft.Chain{Table: tb, Name: chain})
	if err := conn.Flush(); err != nil {
		t.Fatalf("add foreign table %s: %v", name, err)
	}
}

// tableNames lists family/name of every nftables table in the namespace (read
// with google/nftables, independent of internal/nl).
func tableNames(t *testing.T, netns string) []string {
	t.Helper()
	conn, closeConn, err := nftables.Dial(netns, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer closeConn()
	ts, err := conn.ListTables()
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, tb := range ts {
		name := "other"
		switch tb.Family {
		case gnft.TableFamilyINet:
			name = "inet"
		case gnft.TableFamilyIPv4:
			name = "ip"
		case gnft.TableFamilyIPv6:
			name = "ip6"
		}
		out = append(out, name+" "+tb.Name)
	}
	return out
}
