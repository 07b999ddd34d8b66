package policyroute

import (
	"errors"
	"slices"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/pkg/netlink"
	"github.com/meshcni/meshcni/pkg/netlink/nltest"
)

// TestCleanRoutingAnswers: CleanConn's handling of answers a real kernel gives
// only under races or other configurations: an error listing the rules is
// returned (except "family not supported"), an interrupted rule dump is redone
// from scratch, a route dump of one family that also holds another family's routes
// is read for the asked family only, rules to tables 256+ are meshcni's too, and
// without IPv6 nothing is asked about ::6.
func TestCleanRoutingAnswers(t *testing.T) {
	const (
		getRule  = unix.RTM_GETRULE
		getRoute = unix.RTM_GETROUTE
		delRule  = unix.RTM_DELRULE
		delRoute = unix.RTM_DELROUTE
		delAddr  = unix.RTM_DELADDR
	)
	for _, tc := range []struct {
		name    string
		ipv6    bool
		rules   func(r nltest.Req) []byte // the answer to the rule dump
		routes  func(r nltest.Req) []byte // … to a route dump
		wantErr error
		want    []uint16 // requests the kernel sees
	}{
		{
			name:    "rule dump fails",
			rules:   func(r nltest.Req) []byte { return nltest.Ack(r.Seq, unix.EIO) },
			wantErr: unix.EIO,
			want:    []uint16{getRule},
		},
		{
			name: "rule dump fails part-way",
			rules: func(r nltest.Req) []byte {
				return nltest.Cat(nltest.Rule(r.Seq, 0, unix.AF_INET, 0x539, 133), nltest.Ack(r.Seq, unix.ENOMEM))
			},
			wantErr: unix.ENOMEM,
			want:    []uint16{getRule},
		},
		{
			name:  "rule family unsupported",
			rules: func(r nltest.Req) []byte { return nltest.Ack(r.Seq, unix.EOPNOTSUPP) },
			want:  []uint16{getRule},
		},
		{
			name: "interrupted rule dump redone",
			rules: func(r nltest.Req) []byte {
				if r.N == 0 { // a rule that was being deleted while dumped
					return nltest.Cat(nltest.Rule(r.Seq, unix.NLM_F_DUMP_INTR, unix.AF_INET, 0x539, 133), nltest.Done(r.Seq))
				}
				return nltest.Done(r.Seq)
			},
			want: []uint16{getRule, getRule},
		},
		{
			name: "route dump of all families",
			rules: func(r nltest.Req) []byte {
				return nltest.Cat(nltest.Rule(r.Seq, 0, unix.AF_INET, 0x539, 133), nltest.Done(r.Seq))
			},
			routes: func(r nltest.Req) []byte {
				return nltest.Cat(nltest.Route(r.Seq, unix.AF_INET, 133, unix.RTN_LOCAL), nltest.Route(r.Seq, unix.AF_INET6, 133, unix.RTN_LOCAL), nltest.Done(r.Seq))
			},
			want: []uint16{getRule, getRoute, delRule, delRoute},
		},
		{
			name: "table above 255",
			rules: func(r nltest.Req) []byte {
				return nltest.Cat(nltest.Rule(r.Seq, 0, unix.AF_INET, 0x539, 1000), nltest.Done(r.Seq))
			},
			routes: func(r nltest.Req) []byte {
				return nltest.Cat(nltest.Route(r.Seq, unix.AF_INET, 1000, unix.RTN_LOCAL), nltest.Done(r.Seq))
			},
			want: []uint16{getRule, getRoute, delRule, delRoute},
		},
		{
			name: "reserved table",
			rules: func(r nltest.Req) []byte {
				return nltest.Cat(nltest.Rule(r.Seq, 0, unix.AF_INET, 0x539, 253), nltest.Done(r.Seq))
			},
			want: []uint16{getRule},
		},
		{
			name: "route dump fails",
			rules: func(r nltest.Req) []byte {
				return nltest.Cat(nltest.Rule(r.Seq, 0, unix.AF_INET, 0x539, 133), nltest.Done(r.Seq))
			},
			routes:  func(r nltest.Req) []byte { return nltest.Ack(r.Seq, unix.EIO) },
			wantErr: unix.EIO,
			want:    []uint16{getRule, getRoute},
		},
		{
			name:  "with IPv6",
			ipv6:  true,
			rules: func(r nltest.Req) []byte { return nltest.Done(r.Seq) },
			want:  []uint16{getRule, delAddr},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			peer, fd, port := nltest.New(t, func(r nltest.Req) [][]byte {
				switch {
				case r.Typ == getRule:
					return [][]byte{tc.rules(r)}
				case r.Typ == getRoute && tc.routes != nil:
					return [][]byte{tc.routes(r)}
				case r.Typ == delAddr:
					return [][]byte{nltest.Ack(r.Seq, unix.EADDRNOTAVAIL)}
				case r.Typ == delRule || r.Typ == delRoute:
					return [][]byte{nltest.Ack(r.Seq, 0)}
				}
				return [][]byte{nltest.Ack(r.Seq, unix.EINVAL)}
			})
			err := CleanConn(netlink.NewConn(fd, port), tc.ipv6)
			if tc.wantErr == nil && err != nil || tc.wantErr != nil && !errors.Is(err, tc.wantErr) {
				t.Errorf("CleanConn = %v, want %v", err, tc.wantErr)
			}
			if got := peer.Requests(); !slices.Equal(got, tc.want) {
				t.Errorf("requests %v, want %v", got, tc.want)
			}
		})
	}
}

// TestDelAddrGone: removing ::6 succeeds when there is nothing to remove, also
// on a kernel without IPv6 (EOPNOTSUPP with ipv6.disable=1, EAFNOSUPPORT), and
// fails on anything else.
func TestDelAddrGone(t *testing.T) {
	for _, tc := range []struct {
		err  error
		gone bool
	}{
		{unix.EADDRNOTAVAIL, true}, {unix.ENOENT, true}, {unix.ENODEV, true},
		{unix.EAFNOSUPPORT, true}, {unix.EOPNOTSUPP, true},
		{unix.EPERM, false}, {unix.EIO, false}, {unix.EINVAL, false},
	} {
		if got := delAddrGone(tc.err); got != tc.gone {
			t.Errorf("delAddrGone(%v) = %v, want %v", tc.err, got, tc.gone)
		}
	}
}
