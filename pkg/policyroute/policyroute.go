// Package policyroute is meshcni's policy routing in a pod's network namespace:
// for TPROXY, `ip rule fwmark M lookup T` and `ip route add local default dev lo
// table T` per enabled family; for IPv6, the passthrough address ::6 on lo. Apply
// writes them, Check and Clean read and delete them, over pkg/netlink (one
// rtnetlink socket opened in the namespace; its I/O runs from outside it).
package policyroute

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"slices"

	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/pkg/netlink"
	"github.com/meshcni/meshcni/pkg/netnsutil"
	"github.com/meshcni/meshcni/pkg/rules"
	"github.com/meshcni/meshcni/pkg/spec"
)

// ipv6Passthrough is the source the proxy uses for inbound passthrough over IPv6
// (the IPv6 twin of 127.0.0.6); IPv6 loopback is only ::1/128, so it is added to lo.
var ipv6Passthrough = &net.IPNet{IP: net.ParseIP("::6"), Mask: net.CIDRMask(128, 128)}

// loIndex is lo's interface index in every network namespace (the kernel's
// LOOPBACK_IFINDEX).
const loIndex = 1

type routeFamily struct {
	family int
	any    *net.IPNet
}

var routeFamilies = map[rules.Family]routeFamily{
	rules.V4: {unix.AF_INET, &net.IPNet{IP: net.IPv4zero.To4(), Mask: net.CIDRMask(0, 32)}},
	rules.V6: {unix.AF_INET6, &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}},
}

func fams(rs *rules.Ruleset) []rules.Family {
	var out []rules.Family
	for _, f := range []rules.Family{rules.V4, rules.V6} {
		if rs.Families.Has(f) {
			out = append(out, f)
		}
	}
	return out
}

// Apply adds ::6 to lo (IPv6) and, for TPROXY, `ip rule fwmark M lookup T` plus
// `ip route add local default dev lo table T`, per enabled family, in the
// namespace at netns. It does nothing when the ruleset needs neither. An address or
// rule already there is left as it is; the route is replaced.
func Apply(netns string, rs *rules.Ruleset) error {
	if !rs.IPv6Loopback && rs.Route == nil {
		return nil
	}
	r, _, err := Open(netns)
	if err != nil {
		return err
	}
	defer r.Close()
	return ApplyConn(r, rs)
}

// ApplyConn is Apply over the rtnetlink socket r.
func ApplyConn(r *netlink.Conn, rs *rules.Ruleset) error {
	if rs.IPv6Loopback {
		if err := r.DoFlags(unix.RTM_NEWADDR, unix.NLM_F_CREATE|unix.NLM_F_EXCL, passthroughMsg()); err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("add ::6/128 to lo: %w", err)
		}
	}
	if rs.Route == nil {
		return nil
	}
	for _, f := range fams(rs) {
		family := uint8(routeFamilies[f].family)
		if err := r.DoFlags(unix.RTM_NEWRULE, unix.NLM_F_CREATE|unix.NLM_F_EXCL, ruleMsg(family, rs.Route.Mark, rs.Route.Table)); err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("%s rule fwmark %d lookup %d: %w", f, rs.Route.Mark, rs.Route.Table, err)
		}
		if err := r.DoFlags(unix.RTM_NEWROUTE, unix.NLM_F_CREATE|unix.NLM_F_REPLACE, localRouteMsg(family, rs.Route.Table)); err != nil {
			return fmt.Errorf("%s route local default dev lo table %d: %w", f, rs.Route.Table, err)
		}
	}
	return nil
}

// passthroughMsg is the ifaddrmsg (family, prefixlen, flags, scope, index) and
// attributes of ::6/128 on lo, as added and as deleted.
func passthroughMsg() []byte {
	msg := make([]byte, unix.SizeofIfAddrmsg, unix.SizeofIfAddrmsg+2*(unix.SizeofRtAttr+16))
	msg[0], msg[1] = unix.AF_INET6, 128
	binary.NativeEndian.PutUint32(msg[4:8], loIndex)
	msg = netlink.AppendAttr(msg, unix.IFA_LOCAL, ipv6Passthrough.IP.To16())
	return netlink.AppendAttr(msg, unix.IFA_ADDRESS, ipv6Passthrough.IP.To16())
}

// ruleMsg is `ip rule add fwmark mark lookup table` of family: a fib_rule_hdr
// (family, dst_len, src_len, tos, table, res1, res2, action, flags) with action
// FR_ACT_TO_TBL, then FRA_FWMARK and FRA_TABLE (the header's table holds only
// tables below 256).
func ruleMsg(family uint8, mark, table uint32) []byte {
	msg := make([]byte, unix.SizeofRtMsg, unix.SizeofRtMsg+2*(unix.SizeofRtAttr+4))
	msg[0] = family
	if table < 256 {
		msg[4] = uint8(table)
	}
	msg[7] = unix.FR_ACT_TO_TBL
	msg = netlink.AppendAttr(msg, unix.FRA_FWMARK, binary.NativeEndian.AppendUint32(nil, mark))
	return netlink.AppendAttr(msg, unix.FRA_TABLE, binary.NativeEndian.AppendUint32(nil, table))
}

// localRouteMsg is `ip route add local default dev lo table table` of family: an
// rtmsg (family, dst_len 0, src_len, tos, table, protocol boot, scope host, type
// local, flags), then RTA_TABLE and RTA_OIF (lo).
func localRouteMsg(family uint8, table uint32) []byte {
	msg := make([]byte, unix.SizeofRtMsg, unix.SizeofRtMsg+2*(unix.SizeofRtAttr+4))
	msg[0] = family
	msg[4] = unix.RT_TABLE_UNSPEC
	if table < 256 {
		msg[4] = uint8(table)
	}
	msg[5], msg[6], msg[7] = unix.RTPROT_BOOT, unix.RT_SCOPE_HOST, unix.RTN_LOCAL
	msg = netlink.AppendAttr(msg, unix.RTA_TABLE, binary.NativeEndian.AppendUint32(nil, table))
	return netlink.AppendAttr(msg, unix.RTA_OIF, binary.NativeEndian.AppendUint32(nil, loIndex))
}

// Check reports what Apply would add that is missing from the namespace at netns
// (the policy rule and the route, per family; not ::6).
func Check(netns string, rs *rules.Ruleset) ([]string, error) {
	if rs.Route == nil {
		return nil, nil
	}
	r, _, err := Open(netns)
	if err != nil {
		return nil, err
	}
	defer r.Close()
	var missing []string
	for _, f := range fams(rs) {
		family := uint8(routeFamilies[f].family)
		list, err := readRules(r, family, func(rule) bool { return true })
		if err != nil {
			return missing, fmt.Errorf("list %s rules: %w", f, err)
		}
		if !slices.ContainsFunc(list, func(c rule) bool { return c.mark == rs.Route.Mark && c.table == rs.Route.Table }) {
			missing = append(missing, fmt.Sprintf("%s policy rule: fwmark %d lookup %d", f, rs.Route.Mark, rs.Route.Table))
		}
		byTable, err := readRoutes(r, family)
		if err != nil {
			return missing, fmt.Errorf("list %s routes: %w", f, err)
		}
		if !slices.ContainsFunc(byTable[rs.Route.Table], localDefault) {
			missing = append(missing, fmt.Sprintf("%s route: local default dev lo table %d", f, rs.Route.Table))
		}
	}
	return missing, nil
}

// localDefault reports whether a route message (rtmsg: family, dst_len, src_len,
// tos, table, protocol, scope, type, flags) is a local default route.
func localDefault(msg []byte) bool { return msg[7] == unix.RTN_LOCAL && msg[1] == 0 }

// Open opens an rtnetlink socket in the namespace at netns ("" = the current one)
// and reports whether the namespace has IPv6 (see IPv6Here).
func Open(netns string) (r *netlink.Conn, ipv6 bool, err error) {
	err = netnsutil.Do(netns, func() error {
		if r, err = netlink.Open(unix.NETLINK_ROUTE); err != nil {
			return fmt.Errorf("rtnetlink in netns %q: %w", netns, err)
		}
		ipv6 = IPv6Here()
		return nil
	})
	return r, ipv6, err
}

// IPv6Here reports whether the calling thread's namespace has IPv6: without it
// (a kernel booted with ipv6.disable=1) rtnetlink refuses every IPv6 request.
func IPv6Here() bool {
	return unix.Access("/proc/thread-self/net/if_inet6", unix.F_OK) == nil
}

// Clean removes, in the namespace at netns, what CleanConn removes.
func Clean(netns string) error {
	r, ipv6, err := Open(netns)
	if err != nil {
		return err
	}
	defer r.Close()
	return CleanConn(r, ipv6)
}

// noFamily reports whether err says the kernel does not handle a request's address
// family: EAFNOSUPPORT, or EOPNOTSUPP (rtnetlink has no handler for it, as for
// AF_INET6 when the kernel booted with ipv6.disable=1).
func noFamily(err error) bool {
	return errors.Is(err, unix.EAFNOSUPPORT) || errors.Is(err, unix.EOPNOTSUPP)
}

// delAddrGone reports whether removing ::6 from lo failed only because there is
// nothing to remove: the address is not there, lo or IPv6 is not.
func delAddrGone(err error) bool {
	return errors.Is(err, unix.EADDRNOTAVAIL) || errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENODEV) || noFamily(err)
}

// rule is a policy rule read back.
type rule struct {
	family uint8
	mark   uint32
	table  uint32
	msg    []byte // its own message (kept only for the rules CleanConn may delete)
}

// readRules dumps the policy rules of family (AF_UNSPEC: of every family the kernel
// has) and returns those keep accepts.
func readRules(r *netlink.Conn, family uint8, keep func(rule) bool) ([]rule, error) {
	var out []rule
	hdr := make([]byte, unix.SizeofRtMsg)
	hdr[0] = family
	err := r.Dump(unix.RTM_GETRULE, hdr, func() { out = out[:0] }, func(typ uint16, data []byte) {
		if typ != unix.RTM_NEWRULE || len(data) < unix.SizeofRtMsg {
			return
		}
		c := rule{family: data[0], table: uint32(data[4])}
		netlink.Attrs(data[unix.SizeofRtMsg:], func(typ uint16, val []byte) {
			if len(val) < 4 {
				return
			}
			switch typ {
			case unix.FRA_FWMARK:
				c.mark = binary.NativeEndian.Uint32(val)
			case unix.FRA_TABLE:
				c.table = binary.NativeEndian.Uint32(val)
			}
		})
		if keep(c) {
			c.msg = slices.Clone(data)
			out = append(out, c)
		}
	})
	return out, err
}

// readRoutes dumps the routes of family and returns their messages by table.
func readRoutes(r *netlink.Conn, family uint8) (map[uint32][][]byte, error) {
	byTable := map[uint32][][]byte{}
	hdr := make([]byte, unix.SizeofRtMsg)
	hdr[0] = family
	err := r.Dump(unix.RTM_GETROUTE, hdr, func() { clear(byTable) }, func(typ uint16, data []byte) {
		// The kernel may answer a family's dump with every family's routes.
		if typ != unix.RTM_NEWROUTE || len(data) < unix.SizeofRtMsg || data[0] != family {
			return
		}
		table := uint32(data[4])
		netlink.Attrs(data[unix.SizeofRtMsg:], func(typ uint16, val []byte) {
			if typ == unix.RTA_TABLE && len(val) >= 4 {
				table = binary.NativeEndian.Uint32(val)
			}
		})
		byTable[table] = append(byTable[table], slices.Clone(data))
	})
	return byTable, err
}

// familyName names an address family as rules does.
func familyName(family uint8) rules.Family {
	if family == unix.AF_INET6 {
		return rules.V6
	}
	return rules.V4
}

// CleanConn removes, over the rtnetlink socket r, fwmark rules that lead to a
// table whose only job is meshcni's "local default dev lo" route, and that route,
// and ::6 on lo (only when ipv6: the namespace has IPv6, see IPv6Here). One dump
// lists the rules of both families; a family's routes are dumped only when a
// candidate rule exists. A rule or route is deleted by sending its own dumped
// message back as the delete (as `ip rule flush` does).
func CleanConn(r *netlink.Conn, ipv6 bool) error {
	// family AF_UNSPEC: the rules of every family the kernel has.
	cands, err := readRules(r, unix.AF_UNSPEC, func(c rule) bool {
		return (c.family == unix.AF_INET || c.family == unix.AF_INET6 && ipv6) && c.mark != 0 && spec.UsableRouteTable(c.table)
	})
	if err != nil && !noFamily(err) {
		return fmt.Errorf("list policy rules: %w", err)
	}
	var errs []error
	routes := map[uint8]map[uint32][][]byte{} // family → table → its routes' messages
	for _, c := range cands {
		fam := familyName(c.family)
		byTable, ok := routes[c.family]
		if !ok {
			if byTable, err = readRoutes(r, c.family); err != nil {
				// This family's routes cannot be read: leave its rules.
				errs = append(errs, fmt.Errorf("list %s routes: %w", fam, err))
				byTable = nil
			}
			routes[c.family] = byTable
		}
		rs := byTable[c.table]
		if len(rs) != 1 || !localDefault(rs[0]) {
			continue
		}
		if err := r.Do(unix.RTM_DELRULE, c.msg); err != nil && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("delete %s rule fwmark %d lookup %d: %w", fam, c.mark, c.table, err))
		}
		if err := r.Do(unix.RTM_DELROUTE, rs[0]); err != nil && !errors.Is(err, unix.ESRCH) {
			errs = append(errs, fmt.Errorf("delete %s route table %d: %w", fam, c.table, err))
		}
	}
	if !ipv6 {
		return errors.Join(errs...)
	}
	if err := r.Do(unix.RTM_DELADDR, passthroughMsg()); err != nil && !delAddrGone(err) {
		errs = append(errs, fmt.Errorf("remove ::6 from lo: %w", err))
	}
	return errors.Join(errs...)
}
