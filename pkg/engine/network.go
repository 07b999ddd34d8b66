package engine

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"slices"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/pkg/istioflags"
	"github.com/meshcni/meshcni/pkg/netnsutil"
	"github.com/meshcni/meshcni/pkg/rules"
)

// ipv6Passthrough is the source the proxy uses for inbound passthrough over IPv6
// (the IPv6 twin of 127.0.0.6); IPv6 loopback is only ::1/128, so it is added to lo.
var ipv6Passthrough = &net.IPNet{IP: net.ParseIP("::6"), Mask: net.CIDRMask(128, 128)}

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

// applyNetwork adds ::6 to lo (IPv6) and, for TPROXY, `ip rule fwmark M lookup T`
// plus `ip route add local default dev lo table T`, per enabled family.
func applyNetwork(netns string, rs *rules.Ruleset) error {
	if !rs.IPv6Loopback && rs.Route == nil {
		return nil
	}
	return netnsutil.Do(netns, func() error {
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return fmt.Errorf("find lo: %w", err)
		}
		if rs.IPv6Loopback {
			if err := netlink.AddrAdd(lo, &netlink.Addr{IPNet: ipv6Passthrough}); err != nil && !errors.Is(err, unix.EEXIST) {
				return fmt.Errorf("add ::6/128 to lo: %w", err)
			}
		}
		if rs.Route == nil {
			return nil
		}
		for _, f := range fams(rs) {
			rf := routeFamilies[f]
			rule := netlink.NewRule()
			rule.Family = rf.family
			rule.Mark = rs.Route.Mark
			rule.Table = int(rs.Route.Table)
			if err := netlink.RuleAdd(rule); err != nil && !errors.Is(err, unix.EEXIST) {
				return fmt.Errorf("%s rule fwmark %d lookup %d: %w", f, rs.Route.Mark, rs.Route.Table, err)
			}
			route := &netlink.Route{LinkIndex: lo.Attrs().Index, Dst: rf.any, Table: int(rs.Route.Table), Type: unix.RTN_LOCAL, Scope: netlink.SCOPE_HOST, Family: rf.family}
			if err := netlink.RouteReplace(route); err != nil {
				return fmt.Errorf("%s route local default dev lo table %d: %w", f, rs.Route.Table, err)
			}
		}
		return nil
	})
}

// checkNetwork reports what applyNetwork would add that is missing.
func checkNetwork(netns string, rs *rules.Ruleset) ([]string, error) {
	var missing []string
	if rs.Route == nil {
		return nil, nil
	}
	err := netnsutil.Do(netns, func() error {
		for _, f := range fams(rs) {
			rf := routeFamilies[f]
			list, err := netlink.RuleList(rf.family)
			if err != nil {
				return fmt.Errorf("list %s rules: %w", f, err)
			}
			found := false
			for _, r := range list {
				if r.Mark == rs.Route.Mark && r.Table == int(rs.Route.Table) {
					found = true
				}
			}
			if !found {
				missing = append(missing, fmt.Sprintf("%s policy rule: fwmark %d lookup %d", f, rs.Route.Mark, rs.Route.Table))
			}
			routes, err := netlink.RouteListFiltered(rf.family, &netlink.Route{Table: int(rs.Route.Table)}, netlink.RT_FILTER_TABLE)
			if err != nil {
				return fmt.Errorf("list %s routes: %w", f, err)
			}
			found = false
			for _, r := range routes {
				if r.Type == unix.RTN_LOCAL && (r.Dst == nil || isDefault(r.Dst)) {
					found = true
				}
			}
			if !found {
				missing = append(missing, fmt.Sprintf("%s route: local default dev lo table %d", f, rs.Route.Table))
			}
		}
		return nil
	})
	return missing, err
}

func isDefault(n *net.IPNet) bool {
	ones, _ := n.Mask.Size()
	return ones == 0
}

// cleanNetwork removes, in the namespace at netns, what cleanRouting removes.
func cleanNetwork(netns string) error {
	ss, err := openSession(netns, wantRoute, nil)
	if err != nil {
		return err
	}
	defer ss.close()
	return cleanRouting(ss.rt, ss.ipv6)
}

// loIndex is lo's interface index in every network namespace (the kernel's
// LOOPBACK_IFINDEX).
const loIndex = 1

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

// cleanRouting removes, over the rtnetlink socket r, fwmark rules that lead to a
// table whose only job is meshcni's "local default dev lo" route, and that route,
// and ::6 on lo (only when ipv6: the namespace has IPv6, see session.ipv6). One
// dump lists the rules of both families; a family's routes are dumped only when a
// candidate rule exists. A rule or route is deleted by sending its own dumped
// message back as the delete (as `ip rule flush` does).
func cleanRouting(r *nlsock, ipv6 bool) error {
	type candidate struct {
		fam    rules.Family
		family uint8
		mark   uint32
		table  uint32
		msg    []byte
	}
	var cands []candidate
	// family AF_UNSPEC: the rules of every family the kernel has.
	err := r.dump(unix.RTM_GETRULE, make([]byte, unix.SizeofRtMsg), func() { cands = cands[:0] }, func(typ uint16, data []byte) {
		if typ != unix.RTM_NEWRULE || len(data) < unix.SizeofRtMsg {
			return
		}
		c := candidate{family: data[0], table: uint32(data[4])}
		switch {
		case c.family == unix.AF_INET:
			c.fam = rules.V4
		case c.family == unix.AF_INET6 && ipv6:
			c.fam = rules.V6
		default:
			return
		}
		attrs(data[unix.SizeofRtMsg:], func(typ uint16, val []byte) {
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
		if c.mark == 0 || !istioflags.UsableRouteTable(c.table) {
			return
		}
		c.msg = slices.Clone(data)
		cands = append(cands, c)
	})
	if err != nil && !noFamily(err) {
		return fmt.Errorf("list policy rules: %w", err)
	}
	var errs []error
	routes := map[uint8]map[uint32][][]byte{} // family → table → its routes' messages
	for _, c := range cands {
		byTable, ok := routes[c.family]
		if !ok {
			byTable = map[uint32][][]byte{}
			hdr := make([]byte, unix.SizeofRtMsg)
			hdr[0] = c.family
			err := r.dump(unix.RTM_GETROUTE, hdr, func() { clear(byTable) }, func(typ uint16, data []byte) {
				// The kernel may answer a family's dump with every family's routes.
				if typ != unix.RTM_NEWROUTE || len(data) < unix.SizeofRtMsg || data[0] != c.family {
					return
				}
				table := uint32(data[4])
				attrs(data[unix.SizeofRtMsg:], func(typ uint16, val []byte) {
					if typ == unix.RTA_TABLE && len(val) >= 4 {
						table = binary.NativeEndian.Uint32(val)
					}
				})
				byTable[table] = append(byTable[table], slices.Clone(data))
			})
			if err != nil {
				// This family's routes cannot be read: leave its rules.
				errs = append(errs, fmt.Errorf("list %s routes: %w", c.fam, err))
				byTable = nil
			}
			routes[c.family] = byTable
		}
		rs := byTable[c.table]
		// rtmsg: family, dst_len, src_len, tos, table, protocol, scope, type, flags
		if len(rs) != 1 || rs[0][7] != unix.RTN_LOCAL || rs[0][1] != 0 {
			continue
		}
		if err := r.do(unix.RTM_DELRULE, c.msg); err != nil && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("delete %s rule fwmark %d lookup %d: %w", c.fam, c.mark, c.table, err))
		}
		if err := r.do(unix.RTM_DELROUTE, rs[0]); err != nil && !errors.Is(err, unix.ESRCH) {
			errs = append(errs, fmt.Errorf("delete %s route table %d: %w", c.fam, c.table, err))
		}
	}
	if !ipv6 {
		return errors.Join(errs...)
	}
	// ifaddrmsg: family, prefixlen, flags, scope, index
	msg := make([]byte, unix.SizeofIfAddrmsg, unix.SizeofIfAddrmsg+2*(unix.SizeofRtAttr+16))
	msg[0], msg[1] = unix.AF_INET6, 128
	binary.NativeEndian.PutUint32(msg[4:8], loIndex)
	msg = appendAttr(msg, unix.IFA_LOCAL, ipv6Passthrough.IP.To16())
	msg = appendAttr(msg, unix.IFA_ADDRESS, ipv6Passthrough.IP.To16())
	if err := r.do(unix.RTM_DELADDR, msg); err != nil && !delAddrGone(err) {
		errs = append(errs, fmt.Errorf("remove ::6 from lo: %w", err))
	}
	return errors.Join(errs...)
}
