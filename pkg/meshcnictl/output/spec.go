package output

import (
	"net/netip"

	"github.com/meshcni/meshcni/pkg/spec"
)

// RedirectSpec is a pod's redirect (spec.Spec) with camelCase field names.
type RedirectSpec struct {
	Mode                    spec.Mode      `json:"mode"`
	ProxyPort               uint16         `json:"proxyPort"`
	InboundCapturePort      uint16         `json:"inboundCapturePort"`
	InboundTunnelPort       uint16         `json:"inboundTunnelPort"`
	DNSPort                 uint16         `json:"dnsPort,omitempty"`
	ProxyUIDs               []uint32       `json:"proxyUIDs"`
	ProxyGIDs               []uint32       `json:"proxyGIDs"`
	InboundPorts            PortSet        `json:"inboundPorts"`
	InboundPortsExclude     []uint16       `json:"inboundPortsExclude,omitempty"`
	OutboundIPRanges        PrefixSet      `json:"outboundIPRanges"`
	OutboundIPRangesExclude []netip.Prefix `json:"outboundIPRangesExclude,omitempty"`
	OutboundPorts           []uint16       `json:"outboundPorts,omitempty"`
	OutboundPortsExclude    []uint16       `json:"outboundPortsExclude,omitempty"`
	RerouteInterfaces       []string       `json:"rerouteInterfaces,omitempty"`
	ExcludeInterfaces       []string       `json:"excludeInterfaces,omitempty"`
	TProxyMark              uint32         `json:"tproxyMark,omitempty"`
	TProxyRouteTable        uint32         `json:"tproxyRouteTable,omitempty"`
	RedirectDNS             bool           `json:"redirectDNS"`
	CaptureAllDNS           bool           `json:"captureAllDNS"`
	DNSServersV4            []netip.Addr   `json:"dnsServersV4,omitempty"`
	DNSServersV6            []netip.Addr   `json:"dnsServersV6,omitempty"`
	DropInvalid             bool           `json:"dropInvalid"`
	EnableIPv4              bool           `json:"enableIPv4"`
	EnableIPv6              bool           `json:"enableIPv6"`
	// IPv6 is the IPv6 mode; IPv6Captured whether IPv6 is captured under it.
	IPv6               spec.IPv6Mode `json:"ipv6Mode"`
	IPv6Captured       bool          `json:"ipv6Captured"`
	HostLoopback       netip.Prefix  `json:"hostLoopback"`
	OwnerGroupsInclude []string      `json:"ownerGroupsInclude,omitempty"`
	OwnerGroupsExclude []string      `json:"ownerGroupsExclude,omitempty"`
}

// PortSet is spec.PortSet: all ports, or the ones listed.
type PortSet struct {
	All   bool     `json:"all,omitempty"`
	Ports []uint16 `json:"ports,omitempty"`
}

// PrefixSet is spec.PrefixSet: every destination, or the prefixes listed.
type PrefixSet struct {
	All      bool           `json:"all,omitempty"`
	Prefixes []netip.Prefix `json:"prefixes,omitempty"`
}

// Spec returns the view of s (nil for nil).
func Spec(s *spec.Spec) *RedirectSpec {
	if s == nil {
		return nil
	}
	return &RedirectSpec{
		Mode: s.Mode, ProxyPort: s.ProxyPort, InboundCapturePort: s.InboundCapturePort, InboundTunnelPort: s.InboundTunnelPort,
		DNSPort: s.DNSPort, ProxyUIDs: s.ProxyUIDs, ProxyGIDs: s.ProxyGIDs,
		InboundPorts: PortSet{All: s.InboundPorts.All, Ports: s.InboundPorts.Ports}, InboundPortsExclude: s.InboundPortsExclude,
		OutboundIPRanges:        PrefixSet{All: s.OutboundIPRanges.All, Prefixes: s.OutboundIPRanges.Prefixes},
		OutboundIPRangesExclude: s.OutboundIPRangesExclude, OutboundPorts: s.OutboundPorts, OutboundPortsExclude: s.OutboundPortsExclude,
		RerouteInterfaces: s.RerouteInterfaces, ExcludeInterfaces: s.ExcludeInterfaces,
		TProxyMark: s.TProxyMark, TProxyRouteTable: s.TProxyRouteTable,
		RedirectDNS: s.RedirectDNS, CaptureAllDNS: s.CaptureAllDNS, DNSServersV4: s.DNSServersV4, DNSServersV6: s.DNSServersV6,
		DropInvalid: s.DropInvalid, EnableIPv4: s.EnableIPv4, EnableIPv6: s.EnableIPv6,
		IPv6: s.IPv6, IPv6Captured: s.IPv6Captured(), HostLoopback: s.HostLoopback,
		OwnerGroupsInclude: s.OwnerGroups.Include, OwnerGroupsExclude: s.OwnerGroups.Exclude,
	}
}
