package spec_test

import (
	"errors"
	"net/netip"
	"reflect"
	"strings"
	"testing"

	"github.com/meshcni/meshcni/pkg/spec"
)

// Istio's values, written out: istio-iptables' defaults and the injector's per-pod ones.
func TestDefaults(t *testing.T) {
	d := spec.Default()
	want := spec.Spec{
		ProxyPort:          15001,
		InboundCapturePort: 15006,
		InboundTunnelPort:  15008,
		DNSPort:            15053,
		ProxyUIDs:          []uint32{1337},
		ProxyGIDs:          []uint32{1337},
		Mode:               "REDIRECT",
		TProxyMark:         1337,
		TProxyRouteTable:   133,
		EnableIPv4:         true,
		IPv6:               "istio",
		HostLoopback:       netip.MustParsePrefix("127.0.0.1/32"),
	}
	if !reflect.DeepEqual(d, want) {
		t.Errorf("Default() =\n  %+v\nwant\n  %+v", d, want)
	}
	p := spec.PodDefaults()
	want.InboundPorts = spec.PortSet{All: true}
	want.InboundPortsExclude = []uint16{15020, 15021, 15090}
	want.OutboundIPRanges = spec.PrefixSet{All: true}
	if !reflect.DeepEqual(p, want) {
		t.Errorf("PodDefaults() =\n  %+v\nwant\n  %+v", p, want)
	}
	// PodDefaults must not share its exclude list with the package variable.
	p.InboundPortsExclude[0] = 1
	if spec.DefaultExcludeInboundPorts[0] != 15020 {
		t.Error("changing a PodDefaults spec changed DefaultExcludeInboundPorts")
	}
	if spec.OutboundMark != 1338 {
		t.Errorf("OutboundMark = %d, want 1338 (Istio's)", spec.OutboundMark)
	}
}

func TestValidate(t *testing.T) {
	const loopbackReason = "must be an IPv4 loopback prefix inside 127.0.0.0/8"
	for _, tc := range []struct {
		name string
		edit func(s *spec.Spec)
		want []string // the errors, in order; none: valid
	}{
		{"pod defaults", func(*spec.Spec) {}, nil},
		{"TPROXY dual stack", func(s *spec.Spec) { s.Mode, s.EnableIPv6 = spec.ModeTProxy, true }, nil},
		{"IPv6 only", func(s *spec.Spec) { s.EnableIPv4, s.EnableIPv6 = false, true }, nil},
		{"IPv6 only by mode capture", func(s *spec.Spec) { s.EnableIPv4, s.IPv6 = false, spec.IPv6Capture }, nil},
		{"IPv6 mode drop", func(s *spec.Spec) { s.IPv6 = spec.IPv6Drop }, nil},
		{"GIDs only", func(s *spec.Spec) { s.ProxyUIDs = nil }, nil},
		{"UIDs only", func(s *spec.Spec) { s.ProxyGIDs = nil }, nil},
		{"loopback /8", func(s *spec.Spec) { s.HostLoopback = netip.MustParsePrefix("127.0.0.0/8") }, nil},
		{"everything set", func(s *spec.Spec) {
			s.OutboundIPRanges = spec.PrefixSet{Prefixes: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}}
			s.OwnerGroups.Exclude = []string{"nogroup", "3000"}
			s.RerouteInterfaces, s.ExcludeInterfaces = []string{"tun0"}, []string{"eth1"}
			s.RedirectDNS = true
			s.DNSServersV4 = []netip.Addr{netip.MustParseAddr("10.96.0.10")}
			s.DNSServersV6 = []netip.Addr{netip.MustParseAddr("fd00::a")}
		}, nil},

		{"unknown mode", func(s *spec.Spec) { s.Mode = "DNAT" }, []string{`invalid interception mode "DNAT": must be REDIRECT or TPROXY`}},
		{"empty mode", func(s *spec.Spec) { s.Mode = "" }, []string{`invalid interception mode "": must be REDIRECT or TPROXY`}},
		{"proxy port 0", func(s *spec.Spec) { s.ProxyPort = 0 }, []string{`invalid proxy port "0": port must be 1-65535`}},
		{"inbound capture port 0", func(s *spec.Spec) { s.InboundCapturePort = 0 }, []string{`invalid inbound capture port "0": port must be 1-65535`}},
		{"tunnel port 0", func(s *spec.Spec) { s.InboundTunnelPort = 0 }, []string{`invalid inbound tunnel port "0": port must be 1-65535`}},
		{"DNS port 0", func(s *spec.Spec) { s.DNSPort = 0 }, []string{`invalid DNS port "0": port must be 1-65535`}},
		{"no proxy identity", func(s *spec.Spec) { s.ProxyUIDs, s.ProxyGIDs = nil, nil },
			[]string{`invalid proxy UID/GID "": at least one proxy UID or GID is required, or the proxy's own traffic would be captured`}},
		{"'*' and prefixes", func(s *spec.Spec) {
			s.OutboundIPRanges.Prefixes = []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}
		}, []string{`invalid outbound IP ranges "*": '*' cannot be combined with prefixes`}},
		{"include and exclude groups", func(s *spec.Spec) {
			s.OwnerGroups = spec.OwnerGroups{Include: []string{"java"}, Exclude: []string{"nogroup"}}
		}, []string{`invalid owner groups "": include and exclude lists are mutually exclusive`}},
		{"no family", func(s *spec.Spec) { s.EnableIPv4 = false },
			[]string{`invalid IP families "": at least one of IPv4 and IPv6 must be enabled`}},
		{"no family, IPv6 dropped", func(s *spec.Spec) { s.EnableIPv4, s.IPv6 = false, spec.IPv6Drop },
			[]string{`invalid IP families "": at least one of IPv4 and IPv6 must be enabled`}},
		{"unknown IPv6 mode", func(s *spec.Spec) { s.IPv6 = "pass" }, []string{`invalid IPv6 mode "pass": want istio, capture or drop`}},
		{"empty IPv6 mode", func(s *spec.Spec) { s.IPv6 = "" }, []string{`invalid IPv6 mode "": want istio, capture or drop`}},
		{"loopback not loopback", func(s *spec.Spec) { s.HostLoopback = netip.MustParsePrefix("10.0.0.0/8") },
			[]string{`invalid host IPv4 loopback CIDR "10.0.0.0/8": ` + loopbackReason}},
		{"loopback IPv6", func(s *spec.Spec) { s.HostLoopback = netip.MustParsePrefix("::1/128") },
			[]string{`invalid host IPv4 loopback CIDR "::1/128": ` + loopbackReason}},
		{"loopback unset", func(s *spec.Spec) { s.HostLoopback = netip.Prefix{} },
			[]string{`invalid host IPv4 loopback CIDR "invalid Prefix": ` + loopbackReason}},
		{"IPv6 as IPv4 DNS server", func(s *spec.Spec) { s.DNSServersV4 = []netip.Addr{netip.MustParseAddr("fd00::a")} },
			[]string{`invalid IPv4 DNS server "fd00::a": not an IPv4 address`}},
		{"IPv4 as IPv6 DNS server", func(s *spec.Spec) { s.DNSServersV6 = []netip.Addr{netip.MustParseAddr("10.96.0.10")} },
			[]string{`invalid IPv6 DNS server "10.96.0.10": not an IPv6 address`}},
		{"mapped IPv4 as IPv6 DNS server", func(s *spec.Spec) { s.DNSServersV6 = []netip.Addr{netip.MustParseAddr("::ffff:10.96.0.10")} },
			[]string{`invalid IPv6 DNS server "::ffff:10.96.0.10": not an IPv6 address`}},
		{"bad excluded interface", func(s *spec.Spec) { s.ExcludeInterfaces = []string{"eth0", "bad name"} },
			[]string{`invalid interface "bad name": an interface name may only hold letters, digits and - _ . @`}},
		{"empty reroute interface", func(s *spec.Spec) { s.RerouteInterfaces = []string{""} },
			[]string{`invalid interface "": an interface name has 1 to 15 characters`}},
		{"bad owner group", func(s *spec.Spec) { s.OwnerGroups.Include = []string{"9java"} },
			[]string{`invalid owner group "9java": a group name starts with a letter or _`}},
		{"several errors, all reported", func(s *spec.Spec) {
			s.Mode = "DNAT"
			s.ProxyPort = 0
			s.EnableIPv4 = false
			s.OwnerGroups.Exclude = []string{"a b"}
		}, []string{
			`invalid interception mode "DNAT": must be REDIRECT or TPROXY`,
			`invalid proxy port "0": port must be 1-65535`,
			`invalid IP families "": at least one of IPv4 and IPv6 must be enabled`,
			`invalid owner group "a b": a group is a GID or a name of letters, digits, -, _ and dots`,
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := spec.PodDefaults()
			tc.edit(&s)
			err := s.Validate()
			if len(tc.want) == 0 {
				if err != nil {
					t.Fatalf("Validate: %v, want no error", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("Validate: no error, want %q", tc.want)
			}
			if got := strings.Split(err.Error(), "\n"); !reflect.DeepEqual(got, tc.want) {
				t.Errorf("Validate:\n  %s\nwant\n  %s", strings.Join(got, "\n  "), strings.Join(tc.want, "\n  "))
			}
			var fe *spec.FieldError
			if !errors.As(err, &fe) {
				t.Errorf("Validate: %T is not a *FieldError", err)
			}
		})
	}
}

func TestDNSEnabled(t *testing.T) {
	for _, tc := range []struct {
		name string
		edit func(s *spec.Spec)
		want bool
	}{
		{"off", func(*spec.Spec) {}, false},
		{"off, with servers", func(s *spec.Spec) { s.DNSServersV4 = []netip.Addr{netip.MustParseAddr("10.96.0.10")} }, false},
		{"on, no server, not capture-all", func(s *spec.Spec) { s.RedirectDNS = true }, false},
		{"on, capture-all", func(s *spec.Spec) { s.RedirectDNS, s.CaptureAllDNS = true, true }, true},
		{"on, IPv4 server", func(s *spec.Spec) {
			s.RedirectDNS = true
			s.DNSServersV4 = []netip.Addr{netip.MustParseAddr("10.96.0.10")}
		}, true},
		{"on, IPv6 server", func(s *spec.Spec) {
			s.RedirectDNS = true
			s.DNSServersV6 = []netip.Addr{netip.MustParseAddr("fd00::a")}
		}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := spec.PodDefaults()
			tc.edit(&s)
			if got := s.DNSEnabled(); got != tc.want {
				t.Errorf("DNSEnabled() = %v, want %v", got, tc.want)
			}
		})
	}
}

func TestFieldError(t *testing.T) {
	err := &spec.FieldError{Field: "traffic.sidecar.istio.io/includeInboundPorts", Value: `8080,"x"`, Reason: "bad"}
	if got, want := err.Error(), `invalid traffic.sidecar.istio.io/includeInboundPorts "8080,\"x\"": bad`; got != want {
		t.Errorf("Error() = %s, want %s", got, want)
	}
}
