package spec

import (
	"net/netip"
	"strings"
)

// IPv6Mode says what happens to a pod's IPv6 traffic: captured as Istio decides,
// captured always, or, where Istio would let it pass uncaptured, dropped.
type IPv6Mode string

const (
	// IPv6Istio captures IPv6 exactly when Istio writes IPv6 rules (IstioIPv6);
	// otherwise IPv6 passes uncaptured, on every backend, as it does under
	// istio-cni's iptables mode. The default.
	IPv6Istio IPv6Mode = "istio"
	// IPv6Capture writes Istio's IPv6 rules whatever Istio would decide: the proxy
	// must then listen on IPv6 ([::1]:15001 and 15006) too.
	IPv6Capture IPv6Mode = "capture"
	// IPv6Drop is IPv6Istio, except that IPv6 Istio would let pass uncaptured is
	// dropped (fail-closed). What still passes: traffic over lo, ICMPv6 (neighbour
	// discovery), the proxy's own (UID/GID) outbound traffic, and packets of
	// connections conntrack already tracks as established or related (the replies
	// to that traffic).
	IPv6Drop IPv6Mode = "drop"
)

// IPv6Modes lists the modes in the order the docs name them.
var IPv6Modes = []IPv6Mode{IPv6Istio, IPv6Capture, IPv6Drop}

// ParseIPv6Mode parses an IPv6 mode (case-insensitive, surrounding spaces ignored).
// "" is not a mode: a caller with an optional setting checks for it first.
func ParseIPv6Mode(field, s string) (IPv6Mode, error) {
	m := IPv6Mode(strings.ToLower(strings.TrimSpace(s)))
	if m.Valid() {
		return m, nil
	}
	return "", &FieldError{Field: field, Value: s, Reason: "want istio, capture or drop"}
}

// Valid reports whether m is one of IPv6Modes.
func (m IPv6Mode) Valid() bool {
	return m == IPv6Istio || m == IPv6Capture || m == IPv6Drop
}

// IPv6Captured reports whether the spec's IPv6 capture rules are written: Istio
// writes them (EnableIPv6), or the mode is capture.
func (s *Spec) IPv6Captured() bool {
	return s.EnableIPv6 || s.IPv6 == IPv6Capture
}

// IstioIPv6 reports whether Istio writes IPv6 rules for a pod with these addresses,
// given the proxy's ISTIO_DUAL_STACK (dualStack). Istio decides it in the pod's
// netns, in istio.io/istio tools/common/config/config.go: (*Config).
// FillConfigFromEnvironment sets EnableIPv6 from getLocalIP(c.DualStack), which walks
// net.InterfaceAddrs (the kernel lists every IPv4 address before any IPv6 one),
// skipping loopback and link-local addresses:
//
//   - without DUAL_STACK it returns the first address left, so EnableIPv6 is true
//     only when the pod has no IPv4 address but an IPv6 one (an IPv6-only pod);
//   - with DUAL_STACK it goes on to the first IPv6 address, so EnableIPv6 is true
//     when the pod has any IPv6 address.
//
// With EnableIPv6 false, istio-iptables' builder drops every IPv6 rule
// (tools/istio-iptables/pkg/builder/iptables_builder_impl.go: AppendRuleV6 and
// InsertRuleV6 return early) and never runs ip6tables-restore
// (tools/istio-iptables/pkg/capture/run.go: executeCommands), so the pod's IPv6
// passes uncaptured. istio-cni's sidecar plugin reads DUAL_STACK from the proxy's
// ISTIO_DUAL_STACK (cni/pkg/plugin/sidecar_redirect.go: NewRedirect).
func IstioIPv6(dualStack bool, addrs []netip.Addr) bool {
	var v4, v6 bool
	for _, a := range addrs {
		a = a.Unmap()
		if !a.IsValid() || a.IsLoopback() || a.IsLinkLocalUnicast() || a.IsLinkLocalMulticast() {
			continue
		}
		if a.Is4() {
			v4 = true
		} else {
			v6 = true
		}
	}
	if dualStack {
		return v6
	}
	return v6 && !v4
}
