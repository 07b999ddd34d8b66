package netlink

import (
	"bytes"
	"encoding/binary"
	"testing"

	"golang.org/x/sys/unix"
)

// fuzzBodies splits raw at 0xff bytes into at most 16 message bodies.
func fuzzBodies(raw []byte) [][]byte {
	bodies := bytes.SplitN(raw, []byte{0xff}, 16)
	for i, b := range bodies {
		if len(b) > 0xfff0 {
			bodies[i] = b[:0xfff0]
		}
	}
	return bodies
}

// FuzzNetlinkWalk feeds arbitrary bytes to the dump reply walk (nlWalk), the batch
// acknowledgement walk (ackWalk), the attribute walk (Attrs) and the address and
// link decoders (an address kept is valid and unmapped): none panics or
// hands on more bytes than it was given, and a walk that stops on a bad length says
// so (done with an error). Well-formed replies built from the same bytes
// (AppendMsg, AppendAttr) read back exactly: the replies to the request's sequence
// number in order, others skipped, the last one possibly unpadded; the attributes
// with their types and values.
func FuzzNetlinkWalk(f *testing.F) {
	f.Add([]byte{}, uint32(1), false)
	f.Add(AppendMsg(AppendMsg(nil, 0x10, 0, 1, []byte("table\x00")), unix.NLMSG_DONE, 0, 1, []byte{0, 0, 0, 0}), uint32(1), true)
	f.Add(AppendMsg(nil, unix.NLMSG_ERROR, 0, 7, []byte{0xfe, 0xff, 0xff, 0xff}), uint32(7), false)
	f.Add([]byte{0xff, 0xff, 0xff, 0xff, 0x10, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0}, uint32(1), false)
	f.Add(AppendAttr(AppendAttr(nil, 1, []byte("istio-proxy-nat\x00")), 2|unix.NLA_F_NESTED, []byte{0, 0, 0, 7}), uint32(0), true)
	f.Add([]byte{3, 0, 1, 0, 5, 0, 2, 0, 'x', 0, 0, 0}, uint32(0), false)
	f.Fuzz(func(t *testing.T, raw []byte, seq uint32, done bool) {
		// Arbitrary bytes.
		w := &nlWalk{seq: seq}
		handed := 0
		gotDone, err := w.feed(raw, func(_ uint16, data []byte) { handed += unix.SizeofNlMsghdr + len(data) })
		if handed > len(raw) {
			t.Fatalf("nlWalk handed on %d bytes of %d", handed, len(raw))
		}
		if err != nil && !gotDone {
			t.Fatalf("nlWalk: error %v without done", err)
		}
		aw := &ackWalk{first: seq, last: seq + 4, errs: map[uint32]error{}}
		if err := aw.feed(raw); err == nil && aw.got > len(raw)/unix.SizeofNlMsghdr {
			t.Fatalf("ackWalk counted %d answers in %d bytes", aw.got, len(raw))
		}
		handed = 0
		Attrs(raw, func(_ uint16, val []byte) { handed += unix.SizeofRtAttr + len(val) })
		if handed > len(raw) {
			t.Fatalf("Attrs handed on %d bytes of %d", handed, len(raw))
		}
		_ = NfString(raw, 1)
		if a, ok := decodeAddr(unix.RTM_NEWADDR, raw); ok && (!a.IP.IsValid() || a.IP.Is4In6()) {
			t.Fatalf("decodeAddr kept %+v: an address must be valid and unmapped", a)
		}
		if _, ok := decodeLink(unix.RTM_NEWLINK, raw); ok != (len(raw) >= unix.SizeofIfInfomsg) {
			t.Fatalf("decodeLink of %d bytes: %v", len(raw), ok)
		}

		// Well-formed replies, interleaved with replies to another request.
		bodies := fuzzBodies(raw)
		var msgs []byte
		for i, b := range bodies {
			msgs = AppendMsg(msgs, uint16(unix.NLMSG_MIN_TYPE+i), 0, seq+1, []byte("late"))
			msgs = AppendMsg(msgs, uint16(unix.NLMSG_MIN_TYPE+i), unix.NLM_F_MULTI, seq, b)
		}
		if done {
			msgs = AppendMsg(msgs, unix.NLMSG_DONE, unix.NLM_F_MULTI, seq, []byte{0, 0, 0, 0})
		} else {
			last := bodies[len(bodies)-1]
			msgs = msgs[:len(msgs)-(nlAlign(len(last))-len(last))] // the last one unpadded
		}
		var got [][]byte
		w = &nlWalk{seq: seq}
		gotDone, err = w.feed(msgs, func(typ uint16, data []byte) {
			if int(typ) != unix.NLMSG_MIN_TYPE+len(got) {
				t.Fatalf("reply %d has type %d", len(got), typ)
			}
			got = append(got, data)
		})
		if err != nil || gotDone != done || len(got) != len(bodies) {
			t.Fatalf("nlWalk of %d replies: %d handed on, done %v, %v; want %d, done %v", len(bodies), len(got), gotDone, err, len(bodies), done)
		}
		for i := range got {
			if !bytes.Equal(got[i], bodies[i]) {
				t.Fatalf("reply %d = %x, want %x", i, got[i], bodies[i])
			}
		}

		// Well-formed attributes.
		var attrs []byte
		for i, b := range bodies {
			attrs = AppendAttr(attrs, uint16(i)|unix.NLA_F_NESTED, b)
		}
		n := 0
		Attrs(attrs, func(typ uint16, val []byte) {
			if n >= len(bodies) || typ != uint16(n) || !bytes.Equal(val, bodies[n]) {
				t.Fatalf("attribute %d = %d %x", n, typ, val)
			}
			n++
		})
		if n != len(bodies) {
			t.Fatalf("Attrs read %d attributes, want %d", n, len(bodies))
		}
		if len(raw) >= 4 && binary.NativeEndian.Uint16(raw[0:2]) == 0 {
			Attrs(raw, func(uint16, []byte) { t.Fatal("Attrs read an attribute of length 0") })
		}
	})
}
