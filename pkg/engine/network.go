package engine

import (
	"errors"
	"fmt"
	"net"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

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
	return cleanRouting(ss.rt)
}

// loIndex is lo's interface index in every network namespace (the kernel's
// LOOPBACK_IFINDEX).
const loIndex = 1

// cleanRouting removes, over the rtnetlink handle h, fwmark rules that lead to a
// table whose only job is meshcni's "local default dev lo" route, and that route,
// and ::6 on lo. One dump lists the rules of both families; routes are listed only
// for a candidate rule.
func cleanRouting(h *netlink.Handle) error {
	var errs []error
	list, err := h.RuleList(netlink.FAMILY_ALL)
	if err != nil {
		list = nil // no rules to read: nothing of ours to remove
	}
	for _, r := range list {
		var f rules.Family
		switch r.Family {
		case unix.AF_INET:
			f = rules.V4
		case unix.AF_INET6:
			f = rules.V6
		default:
			continue
		}
		if r.Mark == 0 || r.Table <= 0 || r.Table >= 252 {
			continue
		}
		routes, err := h.RouteListFiltered(r.Family, &netlink.Route{Table: r.Table}, netlink.RT_FILTER_TABLE)
		if err != nil || len(routes) != 1 || routes[0].Type != unix.RTN_LOCAL || !(routes[0].Dst == nil || isDefault(routes[0].Dst)) {
			continue
		}
		rule := r
		if err := h.RuleDel(&rule); err != nil && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("delete %s rule fwmark %d lookup %d: %w", f, r.Mark, r.Table, err))
		}
		route := routes[0]
		if err := h.RouteDel(&route); err != nil && !errors.Is(err, unix.ESRCH) {
			errs = append(errs, fmt.Errorf("delete %s route table %d: %w", f, r.Table, err))
		}
	}
	if err := h.AddrDel(nil, &netlink.Addr{IPNet: ipv6Passthrough, LinkIndex: loIndex}); err != nil &&
		!errors.Is(err, unix.EADDRNOTAVAIL) && !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.EAFNOSUPPORT) && !errors.Is(err, unix.ENODEV) {
		errs = append(errs, fmt.Errorf("remove ::6 from lo: %w", err))
	}
	return errors.Join(errs...)
}
