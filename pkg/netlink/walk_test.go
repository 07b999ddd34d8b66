package netlink

import (
	"bytes"
	"encoding/binary"
	"errors"
	"maps"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/pkg/netlink/nltest"
)

// TestNetlinkEncoding: attributes and messages are padded to 4 bytes, their
// lengths exclude the padding, and Attrs reads back what AppendAttr wrote (string
// attributes without their NUL), stopping at a malformed length instead of reading
// past it.
func TestNetlinkEncoding(t *testing.T) {
	for _, tc := range []struct {
		name    string
		vals    [][]byte
		wantLen int // bytes appended
	}{
		{"empty value", [][]byte{{}}, 4},
		{"aligned value", [][]byte{{1, 2, 3, 4}}, 8},
		{"string with NUL, padded", [][]byte{[]byte("nat\x00x")}, 12},
		{"two attributes", [][]byte{[]byte("istio-proxy-nat\x00"), {0, 0, 0, 7}}, 20 + 8},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var b []byte
			for i, v := range tc.vals {
				b = AppendAttr(b, uint16(i+1), v)
			}
			if len(b) != tc.wantLen {
				t.Fatalf("appended %d bytes, want %d", len(b), tc.wantLen)
			}
			var got [][]byte
			Attrs(b, func(typ uint16, val []byte) {
				if int(typ) != len(got)+1 {
					t.Errorf("attribute type %d, want %d", typ, len(got)+1)
				}
				got = append(got, bytes.Clone(val))
			})
			if len(got) != len(tc.vals) {
				t.Fatalf("read %d attributes, want %d", len(got), len(tc.vals))
			}
			for i := range got {
				if !bytes.Equal(got[i], tc.vals[i]) {
					t.Errorf("attribute %d = %q, want %q", i+1, got[i], tc.vals[i])
				}
			}
			msg := AppendMsg(nil, 7, unix.NLM_F_ACK, 42, b[:len(b)-1]) // an unaligned body
			if len(msg)%4 != 0 || binary.NativeEndian.Uint32(msg[0:4]) != uint32(unix.SizeofNlMsghdr+len(b)-1) ||
				binary.NativeEndian.Uint16(msg[6:8]) != unix.NLM_F_ACK|unix.NLM_F_REQUEST || binary.NativeEndian.Uint32(msg[8:12]) != 42 {
				t.Errorf("message header % x (len %d)", msg[:16], len(msg))
			}
		})
	}
	// A length running past the buffer ends the walk.
	bad := AppendAttr(nil, 1, []byte("ok\x00"))
	bad = append(bad, 0xff, 0x00, 2, 0)
	n := 0
	Attrs(bad, func(uint16, []byte) { n++ })
	if n != 1 {
		t.Fatalf("read %d attributes of a truncated list, want 1", n)
	}
	if s := NfString(AppendAttr(nil, unix.NFTA_TABLE_NAME, []byte("istio-proxy-nat\x00")), unix.NFTA_TABLE_NAME); s != "istio-proxy-nat" {
		t.Fatalf("NfString = %q", s)
	}
}

// TestNlWalk: the walk of the replies to one request over one or more receives:
// every message of the request is handed over, replies to other requests are
// skipped, a done message ends it with the error it carries, a dump flagged
// NLM_F_DUMP_INTR ends in ErrDumpInterrupted (after all of it), an acknowledgement
// ends it with its errno, malformed lengths are errors, and a last message without
// its padding is read without running past the buffer.
func TestNlWalk(t *testing.T) {
	const seq = 7
	rule := func(flags uint16, seq uint32) []byte {
		return nltest.Msg(unix.RTM_NEWRULE, flags|unix.NLM_F_MULTI, seq, make([]byte, 12), false)
	}
	done := func(flags uint16, seq uint32, body []byte) []byte {
		return nltest.Msg(unix.NLMSG_DONE, flags|unix.NLM_F_MULTI, seq, body, false)
	}
	for _, tc := range []struct {
		name      string
		bufs      [][]byte // one per receive
		wantCalls []int    // body length of each message handed over
		wantDone  bool
		wantErr   error // errors.Is; nil: none; errMalformed: any error naming a length
	}{
		{"multi-message buffer", [][]byte{nltest.Cat(rule(0, seq), rule(0, seq), done(0, seq, nltest.Errno(0)))}, []int{12, 12}, true, nil},
		{"over two receives", [][]byte{nltest.Cat(rule(0, seq), rule(0, seq)), done(0, seq, nltest.Errno(0))}, []int{12, 12}, true, nil},
		{"unfinished", [][]byte{rule(0, seq)}, []int{12}, false, nil},
		{"done without payload", [][]byte{nltest.Cat(rule(0, seq), done(0, seq, nil))}, []int{12}, true, nil},
		{"done with an error", [][]byte{nltest.Cat(rule(0, seq), done(0, seq, nltest.Errno(unix.EBUSY)))}, []int{12}, true, unix.EBUSY},
		{"dump interrupted", [][]byte{nltest.Cat(rule(0, seq), rule(unix.NLM_F_DUMP_INTR, seq)), done(0, seq, nltest.Errno(0))}, []int{12, 12}, true, ErrDumpInterrupted},
		{"dump interrupted on done", [][]byte{nltest.Cat(rule(0, seq), done(unix.NLM_F_DUMP_INTR, seq, nltest.Errno(0)))}, []int{12}, true, ErrDumpInterrupted},
		{"another request's interrupted dump", [][]byte{nltest.Cat(rule(unix.NLM_F_DUMP_INTR, seq-1), done(0, seq, nil))}, nil, true, nil},
		{"acknowledgement", [][]byte{nltest.Msg(unix.NLMSG_ERROR, 0, seq, append(nltest.Errno(0), make([]byte, 16)...), false)}, nil, true, nil},
		{"negative acknowledgement", [][]byte{nltest.Msg(unix.NLMSG_ERROR, 0, seq, append(nltest.Errno(unix.ENOENT), make([]byte, 16)...), false)}, nil, true, unix.ENOENT},
		{"short error message", [][]byte{nltest.Msg(unix.NLMSG_ERROR, 0, seq, []byte{1, 2}, false)}, nil, true, errMalformed},
		{"replies to other requests skipped", [][]byte{nltest.Cat(rule(0, seq-1), done(0, seq-1, nltest.Errno(unix.EIO)), rule(0, seq), nltest.Msg(unix.NLMSG_ERROR, 0, seq+1, nltest.Errno(unix.EPERM), false), done(0, seq, nil))}, []int{12}, true, nil},
		{"length past the buffer", [][]byte{nltest.Cat(rule(0, seq), nltest.Msg(unix.RTM_NEWRULE, 0, seq, make([]byte, 12), false)[:20])}, []int{12}, true, errMalformed},
		{"length below the header", [][]byte{nltest.Cat(rule(0, seq), func() []byte { m := rule(0, seq); m[0] = 8; return m }())}, []int{12}, true, errMalformed},
		{"last message unpadded", [][]byte{nltest.Msg(unix.RTM_NEWRULE, unix.NLM_F_MULTI, seq, make([]byte, 13), true)}, []int{13}, false, nil},
		{"unpadded, then done", [][]byte{nltest.Msg(unix.RTM_NEWRULE, unix.NLM_F_MULTI, seq, make([]byte, 13), true), done(0, seq, nil)}, []int{13}, true, nil},
		{"trailing bytes shorter than a header", [][]byte{nltest.Cat(rule(0, seq), make([]byte, 8))}, []int{12}, false, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := nlWalk{seq: seq}
			var calls []int
			var gotDone bool
			var err error
			for _, b := range tc.bufs {
				if gotDone, err = w.feed(b, func(typ uint16, data []byte) {
					if typ != unix.RTM_NEWRULE {
						t.Errorf("handed over message type %d", typ)
					}
					calls = append(calls, len(data))
				}); gotDone || err != nil {
					break
				}
			}
			if !slices.Equal(calls, tc.wantCalls) {
				t.Errorf("handed over bodies of %v bytes, want %v", calls, tc.wantCalls)
			}
			if gotDone != tc.wantDone {
				t.Errorf("done = %v, want %v", gotDone, tc.wantDone)
			}
			switch {
			case tc.wantErr == errMalformed:
				if err == nil || !strings.Contains(err.Error(), "netlink") {
					t.Errorf("err = %v, want a malformed-message error", err)
				}
			case tc.wantErr == nil && err != nil, tc.wantErr != nil && !errors.Is(err, tc.wantErr):
				t.Errorf("err = %v, want %v", err, tc.wantErr)
			}
		})
	}
}

// errMalformed stands for "an error about the message's shape" in table tests.
var errMalformed = errors.New("malformed")

// TestAckWalk: the answers to an nf_tables batch (messages 10..13: begin, two
// commands, end): each command's errno is kept by sequence number, other messages
// are skipped, an error on the begin or end refuses the batch, malformed lengths are
// errors, and an unpadded last message is read without running past the buffer.
func TestAckWalk(t *testing.T) {
	ack := func(seq uint32, e unix.Errno) []byte {
		return nltest.Msg(unix.NLMSG_ERROR, 0, seq, append(nltest.Errno(e), make([]byte, 16)...), false)
	}
	for _, tc := range []struct {
		name     string
		buf      []byte
		wantGot  int
		wantErrs map[uint32]error
		wantErr  error
	}{
		{"both answered", nltest.Cat(ack(11, 0), ack(12, unix.ENOENT)), 2, map[uint32]error{12: unix.ENOENT}, nil},
		{"foreign messages skipped", nltest.Cat(ack(9, unix.EIO), nltest.Msg(unix.NLMSG_DONE, 0, 11, nil, false), ack(11, 0), ack(14, unix.EIO)), 1, map[uint32]error{}, nil},
		{"begin refused", nltest.Cat(ack(10, unix.EPERM), ack(11, 0)), 0, map[uint32]error{}, unix.EPERM},
		{"end refused", nltest.Cat(ack(11, 0), ack(13, unix.EINVAL)), 1, map[uint32]error{}, unix.EINVAL},
		{"begin and end acknowledged", nltest.Cat(ack(10, 0), ack(11, 0), ack(13, 0)), 1, map[uint32]error{}, nil},
		{"length past the buffer", nltest.Cat(ack(11, 0), ack(12, 0)[:30]), 1, map[uint32]error{}, errMalformed},
		{"unpadded last message", nltest.Cat(ack(11, 0), nltest.Msg(unix.NLMSG_ERROR, 0, 12, append(nltest.Errno(unix.EBUSY), 1), true)), 2, map[uint32]error{12: unix.EBUSY}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := ackWalk{first: 10, last: 13, errs: map[uint32]error{}}
			err := w.feed(tc.buf)
			switch {
			case tc.wantErr == errMalformed:
				if err == nil || !strings.Contains(err.Error(), "malformed") {
					t.Errorf("err = %v, want a malformed-message error", err)
				}
			case tc.wantErr == nil && err != nil, tc.wantErr != nil && !errors.Is(err, tc.wantErr):
				t.Errorf("err = %v, want %v", err, tc.wantErr)
			}
			if w.got != tc.wantGot || !maps.EqualFunc(w.errs, tc.wantErrs, func(a, b error) bool { return errors.Is(a, b) }) {
				t.Errorf("got %d answers, errors %v; want %d, %v", w.got, w.errs, tc.wantGot, tc.wantErrs)
			}
		})
	}
}
