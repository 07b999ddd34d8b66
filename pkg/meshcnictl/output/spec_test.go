package output

import (
	"encoding/json"
	"reflect"
	"testing"

	"github.com/meshcni/meshcni/pkg/spec"
)

// TestSpecCoversEverySpecField fails when spec.Spec gains a field the view lacks.
func TestSpecCoversEverySpecField(t *testing.T) {
	keyOf := map[string]string{
		"ProxyPort": "proxyPort", "InboundCapturePort": "inboundCapturePort", "InboundTunnelPort": "inboundTunnelPort",
		"DNSPort": "dnsPort", "ProxyUIDs": "proxyUIDs", "ProxyGIDs": "proxyGIDs", "Mode": "mode",
		"InboundPorts": "inboundPorts", "InboundPortsExclude": "inboundPortsExclude",
		"OutboundIPRanges": "outboundIPRanges", "OutboundIPRangesExclude": "outboundIPRangesExclude",
		"OutboundPorts": "outboundPorts", "OutboundPortsExclude": "outboundPortsExclude",
		"RerouteInterfaces": "rerouteInterfaces", "ExcludeInterfaces": "excludeInterfaces",
		"TProxyMark": "tproxyMark", "TProxyRouteTable": "tproxyRouteTable",
		"RedirectDNS": "redirectDNS", "CaptureAllDNS": "captureAllDNS", "DNSServersV4": "dnsServersV4", "DNSServersV6": "dnsServersV6",
		"DropInvalid": "dropInvalid", "EnableIPv4": "enableIPv4", "EnableIPv6": "enableIPv6", "IPv6": "ipv6Mode",
		"HostLoopback": "hostLoopback", "OwnerGroups": "ownerGroupsInclude",
	}
	s := spec.Default()
	s.DNSPort, s.TProxyMark, s.TProxyRouteTable = 15053, 1337, 133
	s.InboundPortsExclude, s.OutboundPorts, s.OutboundPortsExclude = []uint16{1}, []uint16{2}, []uint16{3}
	s.RerouteInterfaces, s.ExcludeInterfaces = []string{"veth0"}, []string{"eth1"}
	s.DNSServersV4, s.DNSServersV6 = s.DNSServersV4[:0], nil
	s.OwnerGroups.Include = []string{"1"}
	s.OutboundIPRangesExclude = nil
	data, err := json.Marshal(Spec(&s))
	if err != nil {
		t.Fatal(err)
	}
	var got map[string]any
	if err := json.Unmarshal(data, &got); err != nil {
		t.Fatal(err)
	}
	st := reflect.TypeFor[spec.Spec]()
	for i := range st.NumField() {
		name := st.Field(i).Name
		key, ok := keyOf[name]
		if !ok {
			t.Errorf("spec.Spec.%s has no field in RedirectSpec", name)
			continue
		}
		if _, ok := got[key]; !ok && key != "dnsServersV4" && key != "dnsServersV6" && key != "outboundIPRangesExclude" {
			t.Errorf("spec.Spec.%s: no %q in %s", name, key, data)
		}
	}
}
