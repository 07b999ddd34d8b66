package netlink

import (
	"bytes"
	"errors"
	"fmt"

	"golang.org/x/sys/unix"
)

// Table names an nftables table.
type Table struct {
	Family uint8 // NFPROTO_*
	Name   string
}

// Chain names an nftables chain (its table's family and its own name).
type Chain struct {
	Family uint8 // NFPROTO_*
	Name   string
}

// NfMsg is the message type of an nf_tables command (unix.NFT_MSG_*).
func NfMsg(cmd int) uint16 { return uint16(unix.NFNL_SUBSYS_NFTABLES<<8 | cmd) }

// NfGen is an nfgenmsg header: family, version, resource id (big-endian).
func NfGen(family uint8, resID uint16) []byte {
	return []byte{family, unix.NFNETLINK_V0, byte(resID >> 8), byte(resID)}
}

// NfString returns the string attribute typ of an nf_tables message's attributes.
func NfString(b []byte, typ uint16) string {
	var out string
	Attrs(b, func(t uint16, val []byte) {
		if t == typ {
			out = string(bytes.TrimRight(val, "\x00"))
		}
	})
	return out
}

// ListTables lists the namespace's nftables tables (every family) over the
// nfnetlink socket c. When the dump fails after its retries, what its last attempt
// listed is returned with the error.
func ListTables(c *Conn) ([]Table, error) {
	var out []Table
	err := c.Dump(NfMsg(unix.NFT_MSG_GETTABLE), NfGen(unix.NFPROTO_UNSPEC, 0), func() { out = out[:0] }, func(typ uint16, data []byte) {
		if typ != NfMsg(unix.NFT_MSG_NEWTABLE) || len(data) < 4 {
			return
		}
		out = append(out, Table{Family: data[0], Name: NfString(data[4:], unix.NFTA_TABLE_NAME)})
	})
	if err != nil {
		return out, fmt.Errorf("list nftables tables: %w", err)
	}
	return out, nil
}

// ListChains lists the namespace's nftables chains (every family) over c.
func ListChains(c *Conn) ([]Chain, error) {
	var out []Chain
	err := c.Dump(NfMsg(unix.NFT_MSG_GETCHAIN), NfGen(unix.NFPROTO_UNSPEC, 0), func() { out = out[:0] }, func(typ uint16, data []byte) {
		if typ != NfMsg(unix.NFT_MSG_NEWCHAIN) || len(data) < 4 {
			return
		}
		out = append(out, Chain{Family: data[0], Name: NfString(data[4:], unix.NFTA_CHAIN_NAME)})
	})
	if err != nil {
		return out, fmt.Errorf("list nftables chains: %w", err)
	}
	return out, nil
}

// DeleteTables deletes tables in one nf_tables batch (all or nothing) over c.
func DeleteTables(c *Conn, tables []Table) error {
	first := c.seq + 1
	b := AppendMsg(nil, unix.NFNL_MSG_BATCH_BEGIN, 0, first, NfGen(unix.AF_UNSPEC, unix.NFNL_SUBSYS_NFTABLES))
	for i, t := range tables {
		body := AppendAttr(NfGen(t.Family, 0), unix.NFTA_TABLE_NAME, append([]byte(t.Name), 0))
		b = AppendMsg(b, NfMsg(unix.NFT_MSG_DELTABLE), unix.NLM_F_ACK, first+1+uint32(i), body)
	}
	last := first + 1 + uint32(len(tables))
	b = AppendMsg(b, unix.NFNL_MSG_BATCH_END, 0, last, NfGen(unix.AF_UNSPEC, unix.NFNL_SUBSYS_NFTABLES))
	c.seq = last
	if err := c.write(b); err != nil {
		return err
	}
	errs, err := c.acks(first, last, len(tables))
	if err != nil {
		return err
	}
	var all []error
	for i, t := range tables {
		if e := errs[first+1+uint32(i)]; e != nil {
			all = append(all, fmt.Errorf("table %s: %w", t.Name, e))
		}
	}
	return errors.Join(all...)
}
