// Package specfixtures is the one table of named redirect specs that the renderers'
// golden tests (pkg/rules/ipt, pkg/rules/nft) render, so both renderers are judged
// on the same inputs. Each spec is written out as typed values, not parsed from
// flags or annotations, and each is valid.
package specfixtures

import (
	"net/netip"

	"github.com/meshcni/meshcni/pkg/spec"
)

// Fixture is one named spec.
type Fixture struct {
	Name string // the golden file's base name
	Doc  string // what the case covers
	Spec *spec.Spec
}

func pod(edit func(s *spec.Spec)) *spec.Spec {
	s := spec.PodDefaults()
	edit(&s)
	return &s
}

func addrs(ss ...string) []netip.Addr {
	var out []netip.Addr
	for _, s := range ss {
		out = append(out, netip.MustParseAddr(s))
	}
	return out
}

func prefixes(ss ...string) []netip.Prefix {
	var out []netip.Prefix
	for _, s := range ss {
		out = append(out, netip.MustParsePrefix(s))
	}
	return out
}

// All returns fresh copies of every fixture, in a fixed order.
func All() []Fixture {
	base := spec.Default()
	return []Fixture{
		{"istio-defaults", "spec.Default: istio-iptables' base flags only (no inbound, no outbound capture)", &base},
		{"pod-defaults", "spec.PodDefaults: capture all inbound but 15020/15021/15090, all outbound, REDIRECT, IPv4", pod(func(*spec.Spec) {})},
		{"pod-ipv6", "pod defaults, dual stack", pod(func(s *spec.Spec) { s.EnableIPv6 = true })},
		{"pod-ipv6-only", "pod defaults, IPv6 only", pod(func(s *spec.Spec) { s.EnableIPv4, s.EnableIPv6 = false, true })},
		{"pod-tproxy-dual", "TPROXY, dual stack", pod(func(s *spec.Spec) { s.Mode, s.EnableIPv6 = spec.ModeTProxy, true })},
		{"tproxy-inbound-ports", "TPROXY capturing inbound 80 and 443 only", pod(func(s *spec.Spec) {
			s.Mode = spec.ModeTProxy
			s.InboundPorts = spec.PortSet{Ports: []uint16{80, 443}}
		})},
		{"ports", "inbound 80 and 8080 only; outbound 3306 always captured, 9000 and 9001 never", pod(func(s *spec.Spec) {
			s.InboundPorts = spec.PortSet{Ports: []uint16{80, 8080}}
			s.InboundPortsExclude = nil
			s.OutboundPorts = []uint16{3306}
			s.OutboundPortsExclude = []uint16{9000, 9001}
		})},
		{"cidrs", "dual stack, outbound to 10.0.0.0/8 and fd00::/8 only, 10.96.0.0/12 and fd00:1::/64 excluded", pod(func(s *spec.Spec) {
			s.EnableIPv6 = true
			s.OutboundIPRanges = spec.PrefixSet{Prefixes: prefixes("10.0.0.0/8", "fd00::/8")}
			s.OutboundIPRangesExclude = prefixes("10.96.0.0/12", "fd00:1::/64")
		})},
		{"interfaces", "eth1 never captured, tun0's traffic treated as outbound", pod(func(s *spec.Spec) {
			s.ExcludeInterfaces = []string{"eth1"}
			s.RerouteInterfaces = []string{"tun0"}
		})},
		{"interfaces-cidrs-tproxy", "TPROXY; eth1 never captured; tun0 rerouted to 10.0.0.0/8 only", pod(func(s *spec.Spec) {
			s.Mode = spec.ModeTProxy
			s.ExcludeInterfaces = []string{"eth1"}
			s.RerouteInterfaces = []string{"tun0"}
			s.OutboundIPRanges = spec.PrefixSet{Prefixes: prefixes("10.0.0.0/8")}
		})},
		{"uid-gid", "proxy UIDs 1337 and 1500, GIDs 1337 and 2000; groups nogroup and 3000 never captured", pod(func(s *spec.Spec) {
			s.ProxyUIDs = []uint32{1337, 1500}
			s.ProxyGIDs = []uint32{1337, 2000}
			s.OwnerGroups.Exclude = []string{"nogroup", "3000"}
		})},
		{"pod-capture-all-dns", "all DNS captured, dual stack, outbound 9000 excluded", pod(func(s *spec.Spec) {
			s.RedirectDNS, s.CaptureAllDNS, s.EnableIPv6 = true, true, true
			s.OutboundPortsExclude = []uint16{9000}
		})},
		{"pod-dns-servers", "DNS to 10.96.0.10 captured; only groups java and 202 captured", pod(func(s *spec.Spec) {
			s.RedirectDNS = true
			s.DNSServersV4 = addrs("10.96.0.10")
			s.OwnerGroups.Include = []string{"java", "202"}
		})},
		{"dns-servers-dual", "DNS to 10.96.0.10 and fd00::a captured, dual stack", pod(func(s *spec.Spec) {
			s.RedirectDNS, s.EnableIPv6 = true, true
			s.DNSServersV4 = addrs("10.96.0.10")
			s.DNSServersV6 = addrs("fd00::a")
		})},
		{"drop-invalid", "conntrack-invalid packets dropped", pod(func(s *spec.Spec) { s.DropInvalid = true })},
		{"pod-ipv6-capture", "IPv6 mode capture: Istio's IPv6 rules although Istio would write none", pod(func(s *spec.Spec) { s.IPv6 = spec.IPv6Capture })},
		{"pod-ipv6-drop", "IPv6 mode drop: IPv6 not captured is dropped but lo, ICMPv6, the proxy's own and established flows", pod(func(s *spec.Spec) { s.IPv6 = spec.IPv6Drop })},
		{"tproxy-dns-ipv6-drop", "IPv6 mode drop with TPROXY, all DNS captured and conntrack-invalid dropped (every base chain)", pod(func(s *spec.Spec) {
			s.Mode, s.IPv6, s.DropInvalid = spec.ModeTProxy, spec.IPv6Drop, true
			s.RedirectDNS, s.CaptureAllDNS = true, true
		})},
		{"pod-ipv6-drop-dual", "IPv6 mode drop for a pod whose IPv6 Istio captures: nothing dropped", pod(func(s *spec.Spec) { s.IPv6, s.EnableIPv6 = spec.IPv6Drop, true })},
	}
}
