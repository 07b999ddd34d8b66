// Package spec is the typed description of one pod's traffic redirect: everything a
// pod's annotations, the CNI configuration or istio-iptables flags can say, parsed
// into typed values (ports, prefixes, interface names, IDs). It is pure: no effects.
//
// The zero value is not useful; start from Default(), which equals Istio's defaults,
// and validate with (*Spec).Validate before rendering rules from it.
package spec

import (
	"errors"
	"fmt"
	"net/netip"
	"strconv"
)

// Mode is the inbound interception mode.
type Mode string

const (
	// ModeRedirect uses NAT REDIRECT (the default; SO_ORIGINAL_DST holds the destination).
	ModeRedirect Mode = "REDIRECT"
	// ModeTProxy uses TPROXY in the mangle table plus a policy route; the original
	// destination is the socket's local address.
	ModeTProxy Mode = "TPROXY"
)

// Istio's well-known ports and values.
const (
	DefaultProxyPort          uint16 = 15001 // outbound capture
	DefaultInboundCapturePort uint16 = 15006 // inbound capture
	DefaultInboundTunnelPort  uint16 = 15008 // HBONE / tunnel, never captured inbound
	DefaultDNSPort            uint16 = 15053 // istio-agent DNS proxy
	DefaultProxyUID           uint32 = 1337
	DefaultProxyGID           uint32 = 1337
	DefaultTProxyMark         uint32 = 1337
	DefaultTProxyRouteTable   uint32 = 133
	// OutboundMark marks the proxy's own loopback traffic to the workload in TPROXY mode.
	OutboundMark uint32 = 1338
)

// Ports that Istio always excludes from inbound capture (status, health, telemetry).
var DefaultExcludeInboundPorts = []uint16{15020, 15021, 15090}

// PortSet is a list of ports, or "all ports" (`*`).
type PortSet struct {
	All   bool
	Ports []uint16
}

// Empty reports whether the set selects nothing.
func (p PortSet) Empty() bool { return !p.All && len(p.Ports) == 0 }

// PrefixSet is a list of CIDR prefixes (IPv4 and IPv6 mixed), or "everything" (`*`).
type PrefixSet struct {
	All      bool
	Prefixes []netip.Prefix
}

// Empty reports whether the set selects nothing.
func (p PrefixSet) Empty() bool { return !p.All && len(p.Prefixes) == 0 }

// V4 returns the IPv4 prefixes, in order.
func (p PrefixSet) V4() []netip.Prefix { return filterPrefixes(p.Prefixes, true) }

// V6 returns the IPv6 prefixes, in order.
func (p PrefixSet) V6() []netip.Prefix { return filterPrefixes(p.Prefixes, false) }

func filterPrefixes(ps []netip.Prefix, v4 bool) []netip.Prefix {
	var out []netip.Prefix
	for _, p := range ps {
		if p.Addr().Is4() == v4 {
			out = append(out, p)
		}
	}
	return out
}

// HasLoopback reports whether a prefix of the set is a loopback range.
func (p PrefixSet) HasLoopback() bool {
	for _, pr := range p.Prefixes {
		if pr.Addr().IsLoopback() {
			return true
		}
	}
	return false
}

// OwnerGroups selects outbound traffic by the socket owner's group: either capture
// only traffic of the Include groups, or capture everything but the Exclude groups.
// At most one of the two lists is set. Groups are names or numeric GIDs, kept as
// given (iptables-restore and nft resolve names themselves; the native backend
// resolves them before building rules).
type OwnerGroups struct {
	Include []string
	Exclude []string
}

// Spec is a pod's redirect, fully typed.
type Spec struct {
	ProxyPort          uint16 // -p: outbound capture port
	InboundCapturePort uint16 // -z: inbound capture port
	InboundTunnelPort  uint16 // -e: tunnel port, never captured inbound
	DNSPort            uint16 // agent DNS proxy port
	ProxyUIDs          []uint32
	ProxyGIDs          []uint32
	Mode               Mode

	InboundPorts        PortSet  // -b: inbound ports to capture (empty: no inbound capture)
	InboundPortsExclude []uint16 // -d

	OutboundIPRanges        PrefixSet      // -i: outbound destinations to capture
	OutboundIPRangesExclude []netip.Prefix // -x
	OutboundPorts           []uint16       // -q: outbound ports always captured
	OutboundPortsExclude    []uint16       // -o

	RerouteInterfaces []string // -k: virtual interfaces whose traffic is treated as outbound
	ExcludeInterfaces []string // -c: interfaces never captured

	TProxyMark       uint32 // -t
	TProxyRouteTable uint32 // -r

	RedirectDNS   bool
	CaptureAllDNS bool
	DNSServersV4  []netip.Addr
	DNSServersV6  []netip.Addr

	DropInvalid bool

	// EnableIPv4 and EnableIPv6 say for which families Istio writes rules (for a
	// pod: IstioIPv6). IPv6 says what happens to IPv6 otherwise (IPv6Captured).
	EnableIPv4 bool
	EnableIPv6 bool
	IPv6       IPv6Mode

	// HostLoopback is the IPv4 loopback range that counts as "localhost"
	// (ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR, default 127.0.0.1/32).
	HostLoopback netip.Prefix

	OwnerGroups OwnerGroups
}

// Default returns Istio's sidecar defaults as istio-iptables applies them when given
// only the base flags: outbound to 15001, inbound to 15006, tunnel 15008, proxy UID and
// GID 1337, REDIRECT, no inbound ports, no outbound ranges, IPv4 only (IPv6 mode
// istio: IPv6 passes uncaptured).
//
// Pods get Istio's per-pod defaults (capture all inbound, all outbound, exclude 15020,
// 15021, 15090 inbound) from PodDefaults.
func Default() Spec {
	return Spec{
		ProxyPort:          DefaultProxyPort,
		InboundCapturePort: DefaultInboundCapturePort,
		InboundTunnelPort:  DefaultInboundTunnelPort,
		DNSPort:            DefaultDNSPort,
		ProxyUIDs:          []uint32{DefaultProxyUID},
		ProxyGIDs:          []uint32{DefaultProxyGID},
		Mode:               ModeRedirect,
		TProxyMark:         DefaultTProxyMark,
		TProxyRouteTable:   DefaultTProxyRouteTable,
		EnableIPv4:         true,
		IPv6:               IPv6Istio,
		HostLoopback:       netip.MustParsePrefix("127.0.0.1/32"),
	}
}

// PodDefaults returns what the sidecar injector's defaults amount to for a pod with
// no traffic annotations: capture every inbound port except Istio's own
// (15020, 15021, 15090) and all outbound traffic.
func PodDefaults() Spec {
	s := Default()
	s.InboundPorts = PortSet{All: true}
	s.InboundPortsExclude = append([]uint16(nil), DefaultExcludeInboundPorts...)
	s.OutboundIPRanges = PrefixSet{All: true}
	return s
}

// FieldError names the field and the value that were rejected.
type FieldError struct {
	Field  string // e.g. "traffic.sidecar.istio.io/includeInboundPorts" or "-b"
	Value  string
	Reason string
}

func (e *FieldError) Error() string {
	return fmt.Sprintf("invalid %s %q: %s", e.Field, e.Value, e.Reason)
}

// Validate checks cross-field rules that parsing alone cannot. Every error is a
// *FieldError (joined with errors.Join when there are several).
func (s *Spec) Validate() error {
	var errs []error
	bad := func(field, value, reason string) {
		errs = append(errs, &FieldError{Field: field, Value: value, Reason: reason})
	}
	if s.Mode != ModeRedirect && s.Mode != ModeTProxy {
		bad("interception mode", string(s.Mode), "must be REDIRECT or TPROXY")
	}
	for _, p := range []struct {
		name string
		v    uint16
	}{{"proxy port", s.ProxyPort}, {"inbound capture port", s.InboundCapturePort}, {"inbound tunnel port", s.InboundTunnelPort}, {"DNS port", s.DNSPort}} {
		if p.v == 0 {
			bad(p.name, "0", "port must be 1-65535")
		}
	}
	if !UsableRouteTable(s.TProxyRouteTable) {
		bad("TPROXY route table", strconv.FormatUint(uint64(s.TProxyRouteTable), 10), ReservedRouteTables)
	}
	if len(s.ProxyUIDs) == 0 && len(s.ProxyGIDs) == 0 {
		bad("proxy UID/GID", "", "at least one proxy UID or GID is required, or the proxy's own traffic would be captured")
	}
	if s.OutboundIPRanges.All && len(s.OutboundIPRanges.Prefixes) > 0 {
		bad("outbound IP ranges", "*", "'*' cannot be combined with prefixes")
	}
	if len(s.OwnerGroups.Include) > 0 && len(s.OwnerGroups.Exclude) > 0 {
		bad("owner groups", "", "include and exclude lists are mutually exclusive")
	}
	if !s.IPv6.Valid() {
		bad("IPv6 mode", string(s.IPv6), "want istio, capture or drop")
	}
	if !s.EnableIPv4 && !s.IPv6Captured() {
		bad("IP families", "", "at least one of IPv4 and IPv6 must be enabled")
	}
	if !s.HostLoopback.IsValid() || !s.HostLoopback.Addr().Is4() || !s.HostLoopback.Addr().IsLoopback() {
		bad("host IPv4 loopback CIDR", s.HostLoopback.String(), "must be an IPv4 loopback prefix inside 127.0.0.0/8")
	}
	for _, a := range s.DNSServersV4 {
		if !a.Is4() {
			bad("IPv4 DNS server", a.String(), "not an IPv4 address")
		}
	}
	for _, a := range s.DNSServersV6 {
		if !a.Is6() || a.Is4In6() {
			bad("IPv6 DNS server", a.String(), "not an IPv6 address")
		}
	}
	for _, name := range append(append([]string(nil), s.RerouteInterfaces...), s.ExcludeInterfaces...) {
		if err := checkInterfaceName(name); err != nil {
			bad("interface", name, err.Error())
		}
	}
	for _, g := range append(append([]string(nil), s.OwnerGroups.Include...), s.OwnerGroups.Exclude...) {
		if err := checkGroupName(g); err != nil {
			bad("owner group", g, err.Error())
		}
	}
	return errors.Join(errs...)
}

// DNSEnabled reports whether DNS capture rules are rendered: REDIRECT_DNS with either
// capture-all or at least one nameserver (Istio disables it otherwise, with a warning).
func (s *Spec) DNSEnabled() bool {
	return s.RedirectDNS && (s.CaptureAllDNS || len(s.DNSServersV4) > 0 || len(s.DNSServersV6) > 0)
}
