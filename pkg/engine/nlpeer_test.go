package engine

import (
	"encoding/binary"
	"errors"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// nlPeer stands in for the kernel on a NETLINK_USERSOCK socket: the client (an
// nlsock addressed to it) sends real netlink requests over a real socket, and the
// peer answers each with the datagrams its script returns. It lets tests give the
// engine's dumpers answers a real kernel gives only under races or other kernels
// (interrupted dumps, errors part-way, other families' routes).
type nlPeer struct {
	fd   int
	stop chan struct{}
	mu   sync.Mutex
	reqs []uint16 // message type of each request, in order
	done chan struct{}
}

// nlReq is one request the peer received.
type nlReq struct {
	typ  uint16
	seq  uint32
	body []byte
	n    int // how many requests of this type came before it
}

// newNlPeer starts a peer answering with script and returns a client nlsock
// talking to it; both close at the end of the test.
func newNlPeer(t *testing.T, script func(r nlReq) [][]byte) (*nlPeer, *nlsock) {
	t.Helper()
	open := func() (int, uint32) {
		fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_USERSOCK)
		if err != nil {
			t.Fatal(err)
		}
		if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
			t.Fatal(err)
		}
		sa, err := unix.Getsockname(fd)
		if err != nil {
			t.Fatal(err)
		}
		return fd, sa.(*unix.SockaddrNetlink).Pid
	}
	pfd, pid := open()
	cfd, _ := open()
	if err := setRcvTimeout(cfd, 2*time.Second); err != nil {
		t.Fatal(err)
	}
	// The peer wakes every 20 ms to see whether the test is over (a netlink
	// socket cannot be shut down to wake a blocked receive).
	if err := setRcvTimeout(pfd, 20*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	p := &nlPeer{fd: pfd, stop: make(chan struct{}), done: make(chan struct{})}
	c := &nlsock{fd: cfd, peer: pid}
	go p.serve(script)
	t.Cleanup(func() {
		c.close()
		close(p.stop)
		<-p.done
		unix.Close(pfd)
	})
	return p, c
}

func (p *nlPeer) serve(script func(r nlReq) [][]byte) {
	defer close(p.done)
	buf := make([]byte, 1<<16)
	count := map[uint16]int{}
	for {
		n, from, err := unix.Recvfrom(p.fd, buf, 0)
		if err == unix.EINTR || err == unix.EAGAIN {
			select {
			case <-p.stop:
				return
			default:
				continue
			}
		}
		if err != nil || n < unix.SizeofNlMsghdr {
			return
		}
		l := min(int(binary.NativeEndian.Uint32(buf[0:4])), n)
		r := nlReq{typ: binary.NativeEndian.Uint16(buf[4:6]), seq: binary.NativeEndian.Uint32(buf[8:12]), body: slices.Clone(buf[unix.SizeofNlMsghdr:l])}
		r.n = count[r.typ]
		count[r.typ]++
		p.mu.Lock()
		p.reqs = append(p.reqs, r.typ)
		p.mu.Unlock()
		for _, d := range script(r) {
			if err := unix.Sendto(p.fd, d, 0, from); err != nil {
				return
			}
		}
	}
}

func (p *nlPeer) requests() []uint16 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.reqs)
}

// nfTableMsg is an NFT_MSG_NEWTABLE dump message of table name in family.
func nfTableMsg(seq uint32, flags uint16, family uint8, name string) []byte {
	return rawMsg(nfMsg(unix.NFT_MSG_NEWTABLE), flags|unix.NLM_F_MULTI, seq, appendAttr(nfgen(family, 0), unix.NFTA_TABLE_NAME, append([]byte(name), 0)), false)
}

func doneMsg(seq uint32) []byte {
	return rawMsg(unix.NLMSG_DONE, unix.NLM_F_MULTI, seq, errnoBody(0), false)
}

// TestProbeTablesRetry: a table dump the kernel flags interrupted is run again
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
		{"interrupted every time", 3, 0, 3, errDumpInterrupted, 1},
		{"fails part-way", 0, unix.ENOBUFS, 1, unix.ENOBUFS, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			peer, c := newNlPeer(t, func(r nlReq) [][]byte {
				if r.typ != nfMsg(unix.NFT_MSG_GETTABLE) {
					return [][]byte{rawMsg(unix.NLMSG_ERROR, 0, r.seq, errnoBody(unix.EINVAL), false)}
				}
				if r.n < tc.interrupted {
					// While it was dumped, meshcni's table went away.
					return [][]byte{cat(nfTableMsg(r.seq, unix.NLM_F_DUMP_INTR, unix.NFPROTO_INET, ours), doneMsg(r.seq))}
				}
				done := rawMsg(unix.NLMSG_DONE, unix.NLM_F_MULTI, r.seq, errnoBody(tc.doneErr), false)
				if tc.doneErr != 0 {
					return [][]byte{cat(nfTableMsg(r.seq, 0, unix.NFPROTO_INET, ours), done)}
				}
				return [][]byte{cat(nfTableMsg(r.seq, 0, unix.NFPROTO_INET, "foreign"), done)}
			})
			p, err := probeTables(c, false)
			if tc.wantErr == nil && err != nil || tc.wantErr != nil && !errors.Is(err, tc.wantErr) {
				t.Fatalf("probeTables = %v, want %v", err, tc.wantErr)
			}
			if len(p.ours) != tc.wantOurs {
				t.Errorf("found our tables %v, want %d", p.ours, tc.wantOurs)
			}
			if got := len(peer.requests()); got != tc.wantTries {
				t.Errorf("%d dump requests, want %d", got, tc.wantTries)
			}
		})
	}
}

// nftTableName is the name of one of meshcni's nftables tables.
func nftTableName(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"istio-proxy-nat", "istio-proxy-mangle"} {
		if ourTable(name) {
			return name
		}
	}
	t.Fatal("no known meshcni table name")
	return ""
}

// TestReceiveTimeout: openNl sets a 5 s receive timeout on its sockets, and a
// request the other end never answers fails once the timeout passes, with an error
// wrapping os.ErrDeadlineExceeded, instead of blocking for ever.
func TestReceiveTimeout(t *testing.T) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_ROUTE)
	if err != nil {
		t.Fatal(err)
	}
	unix.Close(fd)
	s, err := openNl(unix.NETLINK_ROUTE, nil)
	if err != nil {
		t.Fatal(err)
	}
	tv, err := unix.GetsockoptTimeval(s.fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO)
	s.close()
	if err != nil || time.Duration(tv.Nano()) != nlTimeout || nlTimeout != 5*time.Second {
		t.Fatalf("SO_RCVTIMEO of openNl's socket = %v (%v), want %v", time.Duration(tv.Nano()), err, 5*time.Second)
	}

	_, c := newNlPeer(t, func(nlReq) [][]byte { return nil }) // never answers
	if err := setRcvTimeout(c.fd, 100*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	t0 := time.Now()
	go func() { errc <- c.dump(unix.RTM_GETRULE, make([]byte, unix.SizeofRtMsg), nil, func(uint16, []byte) {}) }()
	select {
	case err := <-errc:
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("dump without an answer = %v, want os.ErrDeadlineExceeded", err)
		}
		if d := time.Since(t0); d < 90*time.Millisecond {
			t.Fatalf("gave up after %v, before the timeout", d)
		}
	case <-time.After(3 * time.Second):
		t.Fatal("dump without an answer still waiting after 3 s")
	}
}

// ruleMsg is an RTM_NEWRULE dump message: family, fwmark mark, lookup table.
func ruleMsg(seq uint32, flags uint16, family uint8, mark, table uint32) []byte {
	body := make([]byte, unix.SizeofRtMsg)
	body[0], body[4], body[7] = family, unix.RT_TABLE_UNSPEC, unix.FR_ACT_TO_TBL
	body = appendAttr(body, unix.FRA_FWMARK, binary.NativeEndian.AppendUint32(nil, mark))
	body = appendAttr(body, unix.FRA_TABLE, binary.NativeEndian.AppendUint32(nil, table))
	return rawMsg(unix.RTM_NEWRULE, flags|unix.NLM_F_MULTI, seq, body, false)
}

// routeMsg is an RTM_NEWROUTE dump message: a default route of type typ in table.
func routeMsg(seq uint32, family uint8, table uint32, typ uint8) []byte {
	body := make([]byte, unix.SizeofRtMsg)
	body[0], body[4], body[7] = family, unix.RT_TABLE_COMPAT, typ
	body = appendAttr(body, unix.RTA_TABLE, binary.NativeEndian.AppendUint32(nil, table))
	return rawMsg(unix.RTM_NEWROUTE, unix.NLM_F_MULTI, seq, body, false)
}

func ackMsg(seq uint32, e unix.Errno) []byte {
	return rawMsg(unix.NLMSG_ERROR, 0, seq, append(errnoBody(e), make([]byte, 16)...), false)
}

// TestCleanRoutingAnswers: cleanRouting's handling of answers a real kernel gives
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
		rules   func(r nlReq) []byte // the answer to the rule dump
		routes  func(r nlReq) []byte // … to a route dump
		wantErr error
		want    []uint16 // requests the kernel sees
	}{
		{
			name:    "rule dump fails",
			rules:   func(r nlReq) []byte { return ackMsg(r.seq, unix.EIO) },
			wantErr: unix.EIO,
			want:    []uint16{getRule},
		},
		{
			name: "rule dump fails part-way",
			rules: func(r nlReq) []byte {
				return cat(ruleMsg(r.seq, 0, unix.AF_INET, 0x539, 133), ackMsg(r.seq, unix.ENOMEM))
			},
			wantErr: unix.ENOMEM,
			want:    []uint16{getRule},
		},
		{
			name:  "rule family unsupported",
			rules: func(r nlReq) []byte { return ackMsg(r.seq, unix.EOPNOTSUPP) },
			want:  []uint16{getRule},
		},
		{
			name: "interrupted rule dump redone",
			rules: func(r nlReq) []byte {
				if r.n == 0 { // a rule that was being deleted while dumped
					return cat(ruleMsg(r.seq, unix.NLM_F_DUMP_INTR, unix.AF_INET, 0x539, 133), doneMsg(r.seq))
				}
				return doneMsg(r.seq)
			},
			want: []uint16{getRule, getRule},
		},
		{
			name:  "route dump of all families",
			rules: func(r nlReq) []byte { return cat(ruleMsg(r.seq, 0, unix.AF_INET, 0x539, 133), doneMsg(r.seq)) },
			routes: func(r nlReq) []byte {
				return cat(routeMsg(r.seq, unix.AF_INET, 133, unix.RTN_LOCAL), routeMsg(r.seq, unix.AF_INET6, 133, unix.RTN_LOCAL), doneMsg(r.seq))
			},
			want: []uint16{getRule, getRoute, delRule, delRoute},
		},
		{
			name:   "table above 255",
			rules:  func(r nlReq) []byte { return cat(ruleMsg(r.seq, 0, unix.AF_INET, 0x539, 1000), doneMsg(r.seq)) },
			routes: func(r nlReq) []byte { return cat(routeMsg(r.seq, unix.AF_INET, 1000, unix.RTN_LOCAL), doneMsg(r.seq)) },
			want:   []uint16{getRule, getRoute, delRule, delRoute},
		},
		{
			name:  "reserved table",
			rules: func(r nlReq) []byte { return cat(ruleMsg(r.seq, 0, unix.AF_INET, 0x539, 253), doneMsg(r.seq)) },
			want:  []uint16{getRule},
		},
		{
			name:    "route dump fails",
			rules:   func(r nlReq) []byte { return cat(ruleMsg(r.seq, 0, unix.AF_INET, 0x539, 133), doneMsg(r.seq)) },
			routes:  func(r nlReq) []byte { return ackMsg(r.seq, unix.EIO) },
			wantErr: unix.EIO,
			want:    []uint16{getRule, getRoute},
		},
		{
			name:  "with IPv6",
			ipv6:  true,
			rules: func(r nlReq) []byte { return doneMsg(r.seq) },
			want:  []uint16{getRule, delAddr},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			peer, c := newNlPeer(t, func(r nlReq) [][]byte {
				switch {
				case r.typ == getRule:
					return [][]byte{tc.rules(r)}
				case r.typ == getRoute && tc.routes != nil:
					return [][]byte{tc.routes(r)}
				case r.typ == delAddr:
					return [][]byte{ackMsg(r.seq, unix.EADDRNOTAVAIL)}
				case r.typ == delRule || r.typ == delRoute:
					return [][]byte{ackMsg(r.seq, 0)}
				}
				return [][]byte{ackMsg(r.seq, unix.EINVAL)}
			})
			err := cleanRouting(c, tc.ipv6)
			if tc.wantErr == nil && err != nil || tc.wantErr != nil && !errors.Is(err, tc.wantErr) {
				t.Errorf("cleanRouting = %v, want %v", err, tc.wantErr)
			}
			if got := peer.requests(); !slices.Equal(got, tc.want) {
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
