// Package istioflags reads istio-iptables compatible flags and environment variables
// into a typed spec, so meshcnictl can stand in for istio-iptables (for example as
// the init-container fallback) with the same command line.
package istioflags

import (
	"fmt"
	"net/netip"
	"strings"

	"github.com/spf13/pflag"

	"github.com/meshcni/meshcni/pkg/spec"
)

// Values holds the raw strings of the flags, as istio-iptables takes them.
type Values struct {
	ProxyPort, InboundCapturePort, InboundTunnelPort string
	ProxyUID, ProxyGID                               string
	Mode                                             string
	TProxyMark, TProxyRouteTable                     string
	InboundPorts, InboundPortsExclude                string
	OutboundPorts, OutboundPortsExclude              string
	IPRanges, IPRangesExclude                        string
	VirtInterfaces, ExcludeInterfaces                string
	RedirectDNS, CaptureAllDNS, DropInvalid          bool
	DualStack                                        bool
	OwnerGroupsInclude, OwnerGroupsExclude           string
	HostLoopback                                     string
}

// flag describes one istio-iptables flag: its long and short names and the
// environment variable that provides its default.
type flag struct {
	long, short, env, def, usage string
	target                       func(*Values) *string
}

var stringFlags = []flag{
	{"envoy-port", "p", "ENVOY_PORT", "15001", "port to which all outbound TCP traffic is redirected", func(v *Values) *string { return &v.ProxyPort }},
	{"inbound-capture-port", "z", "INBOUND_CAPTURE_PORT", "15006", "port to which all inbound TCP traffic is redirected", func(v *Values) *string { return &v.InboundCapturePort }},
	{"inbound-tunnel-port", "e", "INBOUND_TUNNEL_PORT", "15008", "tunnel port, never captured inbound", func(v *Values) *string { return &v.InboundTunnelPort }},
	{"proxy-uid", "u", "PROXY_UID", "", "comma-separated UIDs whose traffic is not captured (default 1337)", func(v *Values) *string { return &v.ProxyUID }},
	{"proxy-gid", "g", "PROXY_GID", "", "comma-separated GIDs whose traffic is not captured (default: the proxy UIDs)", func(v *Values) *string { return &v.ProxyGID }},
	{"istio-inbound-interception-mode", "m", "ISTIO_INBOUND_INTERCEPTION_MODE", "", "inbound interception mode: REDIRECT or TPROXY", func(v *Values) *string { return &v.Mode }},
	{"istio-inbound-tproxy-mark", "t", "ISTIO_INBOUND_TPROXY_MARK", "1337", "TPROXY packet mark", func(v *Values) *string { return &v.TProxyMark }},
	{"istio-inbound-tproxy-route-table", "r", "ISTIO_INBOUND_TPROXY_ROUTE_TABLE", "133", "TPROXY policy route table", func(v *Values) *string { return &v.TProxyRouteTable }},
	{"istio-inbound-ports", "b", "ISTIO_INBOUND_PORTS", "", "inbound ports to capture, '*' for all, empty for none", func(v *Values) *string { return &v.InboundPorts }},
	{"istio-local-exclude-ports", "d", "ISTIO_LOCAL_EXCLUDE_PORTS", "", "inbound ports not captured (with -b '*')", func(v *Values) *string { return &v.InboundPortsExclude }},
	{"istio-outbound-ports", "q", "ISTIO_OUTBOUND_PORTS", "", "outbound ports always captured", func(v *Values) *string { return &v.OutboundPorts }},
	{"istio-local-outbound-ports-exclude", "o", "ISTIO_LOCAL_OUTBOUND_PORTS_EXCLUDE", "", "outbound ports never captured", func(v *Values) *string { return &v.OutboundPortsExclude }},
	{"istio-service-cidr", "i", "ISTIO_SERVICE_CIDR", "", "outbound CIDRs to capture, '*' for all", func(v *Values) *string { return &v.IPRanges }},
	{"istio-service-exclude-cidr", "x", "ISTIO_SERVICE_EXCLUDE_CIDR", "", "outbound CIDRs never captured", func(v *Values) *string { return &v.IPRangesExclude }},
	{"kube-virt-interfaces", "k", "ISTIO_KUBE_VIRT_INTERFACES", "", "virtual interfaces whose traffic is treated as outbound", func(v *Values) *string { return &v.VirtInterfaces }},
	{"istio-exclude-interfaces", "c", "ISTIO_EXCLUDE_INTERFACES", "", "interfaces never captured", func(v *Values) *string { return &v.ExcludeInterfaces }},
}

// Env variables read without a flag, as istio-iptables does.
const (
	EnvOwnerGroups        = "ISTIO_OUTBOUND_OWNER_GROUPS"
	EnvOwnerGroupsExclude = "ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE"
	EnvHostLoopback       = "ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR"
)

// Register adds istio-iptables' flags to fs, with defaults from getenv, and returns
// the Values they fill.
func Register(fs *pflag.FlagSet, getenv func(string) string) *Values {
	v := &Values{}
	for _, f := range stringFlags {
		def := f.def
		if e := getenv(f.env); e != "" {
			def = e
		}
		fs.StringVarP(f.target(v), f.long, f.short, def, f.usage+" (env "+f.env+")")
	}
	envBool := func(name string) bool {
		b, _ := spec.ParseBool(name, getenv(name))
		return b
	}
	fs.BoolVar(&v.RedirectDNS, "redirect-dns", envBool("ISTIO_META_DNS_CAPTURE"), "capture DNS to the agent's DNS proxy (env ISTIO_META_DNS_CAPTURE)")
	fs.BoolVar(&v.CaptureAllDNS, "capture-all-dns", false, "capture DNS to any server, not only resolv.conf's")
	fs.BoolVar(&v.DropInvalid, "drop-invalid", envBool("INVALID_DROP"), "drop packets conntrack marks INVALID (env INVALID_DROP)")
	fs.BoolVar(&v.DualStack, "dual-stack", envBool("ISTIO_DUAL_STACK"), "enable IPv6 rules (env ISTIO_DUAL_STACK)")
	v.OwnerGroupsInclude = getenv(EnvOwnerGroups)
	v.OwnerGroupsExclude = getenv(EnvOwnerGroupsExclude)
	v.HostLoopback = getenv(EnvHostLoopback)
	return v
}

// Spec turns the raw values into a validated spec. Every error names the flag and
// the value.
func (v *Values) Spec() (*spec.Spec, error) {
	s := spec.Default()
	var err error
	fieldName := func(long string) string {
		for _, f := range stringFlags {
			if f.long == long {
				return "-" + f.short + "/--" + f.long
			}
		}
		return "--" + long
	}
	port := func(long, val string, dst *uint16) {
		if err != nil {
			return
		}
		*dst, err = spec.ParsePort(fieldName(long), val)
	}
	port("envoy-port", v.ProxyPort, &s.ProxyPort)
	port("inbound-capture-port", v.InboundCapturePort, &s.InboundCapturePort)
	port("inbound-tunnel-port", v.InboundTunnelPort, &s.InboundTunnelPort)
	if err != nil {
		return nil, err
	}
	if strings.TrimSpace(v.ProxyUID) != "" {
		if s.ProxyUIDs, err = spec.ParseIDList(fieldName("proxy-uid"), v.ProxyUID); err != nil {
			return nil, err
		}
	}
	if strings.TrimSpace(v.ProxyGID) != "" {
		if s.ProxyGIDs, err = spec.ParseIDList(fieldName("proxy-gid"), v.ProxyGID); err != nil {
			return nil, err
		}
	} else if strings.TrimSpace(v.ProxyUID) != "" {
		s.ProxyGIDs = append([]uint32(nil), s.ProxyUIDs...)
	}
	if s.Mode, err = spec.ParseMode(fieldName("istio-inbound-interception-mode"), v.Mode); err != nil {
		return nil, err
	}
	if s.TProxyMark, err = spec.ParseID(fieldName("istio-inbound-tproxy-mark"), v.TProxyMark); err != nil {
		return nil, err
	}
	if s.TProxyRouteTable, err = spec.ParseID(fieldName("istio-inbound-tproxy-route-table"), v.TProxyRouteTable); err != nil {
		return nil, err
	}
	if !spec.UsableRouteTable(s.TProxyRouteTable) {
		return nil, &spec.FieldError{Field: fieldName("istio-inbound-tproxy-route-table"), Value: v.TProxyRouteTable, Reason: spec.ReservedRouteTables}
	}
	if s.InboundPorts, err = spec.ParsePortSet(fieldName("istio-inbound-ports"), v.InboundPorts); err != nil {
		return nil, err
	}
	if s.InboundPortsExclude, err = spec.ParseExcludePortList(fieldName("istio-local-exclude-ports"), v.InboundPortsExclude); err != nil {
		return nil, err
	}
	if s.OutboundPorts, err = spec.ParsePortList(fieldName("istio-outbound-ports"), v.OutboundPorts); err != nil {
		return nil, err
	}
	if s.OutboundPortsExclude, err = spec.ParseExcludePortList(fieldName("istio-local-outbound-ports-exclude"), v.OutboundPortsExclude); err != nil {
		return nil, err
	}
	if s.OutboundIPRanges, err = spec.ParsePrefixSet(fieldName("istio-service-cidr"), v.IPRanges); err != nil {
		return nil, err
	}
	if strings.TrimSpace(v.IPRangesExclude) == "*" {
		return nil, &spec.FieldError{Field: fieldName("istio-service-exclude-cidr"), Value: v.IPRangesExclude, Reason: "'*' would exclude everything; list CIDRs"}
	}
	if s.OutboundIPRangesExclude, err = spec.ParsePrefixList(fieldName("istio-service-exclude-cidr"), v.IPRangesExclude); err != nil {
		return nil, err
	}
	if s.RerouteInterfaces, err = spec.ParseInterfaceList(fieldName("kube-virt-interfaces"), v.VirtInterfaces); err != nil {
		return nil, err
	}
	if s.ExcludeInterfaces, err = spec.ParseInterfaceList(fieldName("istio-exclude-interfaces"), v.ExcludeInterfaces); err != nil {
		return nil, err
	}
	s.RedirectDNS, s.CaptureAllDNS, s.DropInvalid = v.RedirectDNS, v.CaptureAllDNS, v.DropInvalid
	s.EnableIPv6 = v.DualStack
	if s.OwnerGroups.Include, err = spec.ParseGroupList(EnvOwnerGroups, v.OwnerGroupsInclude); err != nil {
		return nil, err
	}
	if s.OwnerGroups.Exclude, err = spec.ParseGroupList(EnvOwnerGroupsExclude, v.OwnerGroupsExclude); err != nil {
		return nil, err
	}
	if len(s.OwnerGroups.Include) > 0 && len(s.OwnerGroups.Exclude) > 0 {
		return nil, &spec.FieldError{Field: EnvOwnerGroups + "/" + EnvOwnerGroupsExclude, Value: v.OwnerGroupsInclude + " / " + v.OwnerGroupsExclude, Reason: "set only one of the two"}
	}
	if strings.TrimSpace(v.HostLoopback) != "" {
		p, perr := spec.ParsePrefix(EnvHostLoopback, v.HostLoopback)
		if perr != nil {
			return nil, perr
		}
		s.HostLoopback = p
	}
	if err := s.Validate(); err != nil {
		return nil, err
	}
	return &s, nil
}

// Parse parses istio-iptables arguments (and env) into a spec, without DNS servers
// or IPv6 detection: callers add those from the network namespace (see
// ResolvConfServers and the netns's addresses).
func Parse(args []string, getenv func(string) string) (*spec.Spec, error) {
	fs := pflag.NewFlagSet("istio-iptables", pflag.ContinueOnError)
	fs.SetOutput(discard{})
	v := Register(fs, getenv)
	if err := fs.Parse(args); err != nil {
		return nil, fmt.Errorf("istio-iptables flags: %w", err)
	}
	return v.Spec()
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }

// ResolvConfServers returns the nameservers of a resolv.conf, split by family, as
// istio-iptables reads them (link-local zones dropped, duplicates kept out).
func ResolvConfServers(data []byte) (v4, v6 []netip.Addr) {
	seen := map[netip.Addr]bool{}
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 || f[0] != "nameserver" {
			continue
		}
		a, err := netip.ParseAddr(f[1])
		if err != nil {
			continue
		}
		a = a.WithZone("").Unmap()
		if seen[a] {
			continue
		}
		seen[a] = true
		if a.Is4() {
			v4 = append(v4, a)
		} else {
			v6 = append(v6, a)
		}
	}
	return v4, v6
}
