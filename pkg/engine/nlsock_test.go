package engine

import (
	"bytes"
	"encoding/binary"
	"testing"

	"golang.org/x/sys/unix"
)

// TestNetlinkEncoding: attributes and messages are padded to 4 bytes, their
// lengths exclude the padding, and attrs reads back what appendAttr wrote (string
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
				b = appendAttr(b, uint16(i+1), v)
			}
			if len(b) != tc.wantLen {
				t.Fatalf("appended %d bytes, want %d", len(b), tc.wantLen)
			}
			var got [][]byte
			attrs(b, func(typ uint16, val []byte) {
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
			msg := appendMsg(nil, 7, unix.NLM_F_ACK, 42, b[:len(b)-1]) // an unaligned body
			if len(msg)%4 != 0 || binary.NativeEndian.Uint32(msg[0:4]) != uint32(unix.SizeofNlMsghdr+len(b)-1) ||
				binary.NativeEndian.Uint16(msg[6:8]) != unix.NLM_F_ACK|unix.NLM_F_REQUEST || binary.NativeEndian.Uint32(msg[8:12]) != 42 {
				t.Errorf("message header % x (len %d)", msg[:16], len(msg))
			}
		})
	}
	// A length running past the buffer ends the walk.
	bad := appendAttr(nil, 1, []byte("ok\x00"))
	bad = append(bad, 0xff, 0x00, 2, 0)
	n := 0
	attrs(bad, func(uint16, []byte) { n++ })
	if n != 1 {
		t.Fatalf("read %d attributes of a truncated list, want 1", n)
	}
	if s := nfString(appendAttr(nil, unix.NFTA_TABLE_NAME, []byte("istio-proxy-nat\x00")), unix.NFTA_TABLE_NAME); s != "istio-proxy-nat" {
		t.Fatalf("nfString = %q", s)
	}
}
