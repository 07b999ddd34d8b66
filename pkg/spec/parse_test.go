package spec_test

import (
	"errors"
	"fmt"
	"net/netip"
	"reflect"
	"strings"
	"testing"

	"github.com/meshcni/meshcni/pkg/spec"
)

// checkErr compares err with the exact wanted text ("" = no error) and checks that
// an error is a *FieldError naming the field and the value as given.
func checkErr(t *testing.T, err error, field, value, want string) bool {
	t.Helper()
	if want == "" {
		if err != nil {
			t.Errorf("error %q, want none", err)
		}
		return err == nil
	}
	if err == nil {
		t.Errorf("no error, want %q", want)
		return false
	}
	if err.Error() != want {
		t.Errorf("error\n  %s\nwant\n  %s", err, want)
	}
	var fe *spec.FieldError
	if !errors.As(err, &fe) || fe.Field != field || fe.Value != value {
		t.Errorf("error %#v is not a *FieldError{Field: %q, Value: %q}", err, field, value)
	}
	return false
}

// list makes "1,2,...,n" from item(i).
func list(n int, item func(i int) string) string {
	items := make([]string, n)
	for i := range items {
		items[i] = item(i)
	}
	return strings.Join(items, ",")
}

const (
	portReason = "a port must be a whole number from 1 to 65535"
	idReason   = "a UID/GID must be a whole number from 0 to 4294967294"
)

func TestParsePort(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want uint16
		err  string
	}{
		{"15001", 15001, ""},
		{"1", 1, ""},
		{"65535", 65535, ""},
		{" 80 ", 80, ""},
		{"0", 0, `invalid -p "0": ` + portReason},
		{"65536", 0, `invalid -p "65536": ` + portReason},
		{"-1", 0, `invalid -p "-1": ` + portReason},
		{"+80", 0, `invalid -p "+80": ` + portReason},
		{"0x50", 0, `invalid -p "0x50": ` + portReason},
		{"80a", 0, `invalid -p "80a": ` + portReason},
		{"", 0, `invalid -p "": ` + portReason},
		{"*", 0, `invalid -p "*": ` + portReason},
	} {
		t.Run(tc.in, func(t *testing.T) {
			got, err := spec.ParsePort("-p", tc.in)
			if checkErr(t, err, "-p", tc.in, tc.err) && got != tc.want {
				t.Errorf("ParsePort(%q) = %d, want %d", tc.in, got, tc.want)
			}
		})
	}
}

func TestParsePortList(t *testing.T) {
	const f = "traffic.sidecar.istio.io/excludeOutboundPorts"
	for _, tc := range []struct {
		name, in string
		want     []uint16
		err      string
	}{
		{"two", "80,443", []uint16{80, 443}, ""},
		{"spaces and trailing comma", " 6000 , 7000,", []uint16{6000, 7000}, ""},
		{"duplicates dropped, order kept", "443,80,443,80", []uint16{443, 80}, ""},
		{"empty", "", nil, ""},
		{"only commas", " , ,", nil, ""},
		{"256 ports", list(256, func(i int) string { return fmt.Sprint(i + 1) }), func() []uint16 {
			var ps []uint16
			for i := range 256 {
				ps = append(ps, uint16(i+1))
			}
			return ps
		}(), ""},
		{"wildcard", "80,*", nil, `invalid ` + f + ` "80,*": '*' is not allowed here`},
		{"bad item", "80,x", nil, `invalid ` + f + ` "80,x": "x": ` + portReason},
		{"zero", "0", nil, `invalid ` + f + ` "0": "0": ` + portReason},
		{"too big", "80,70000", nil, `invalid ` + f + ` "80,70000": "70000": ` + portReason},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := spec.ParsePortList(f, tc.in)
			if checkErr(t, err, f, tc.in, tc.err) && !reflect.DeepEqual(got, tc.want) {
				t.Errorf("ParsePortList(%q) = %v, want %v", tc.in, got, tc.want)
			}
		})
	}
	in := list(257, func(i int) string { return fmt.Sprint(i + 1) })
	_, err := spec.ParsePortList(f, in)
	checkErr(t, err, f, in, `invalid `+f+` "`+in+`": more than 256 ports`)
}

func TestParsePortSet(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want spec.PortSet
		err  string
	}{
		{"*", spec.PortSet{All: true}, ""},
		{" * ", spec.PortSet{All: true}, ""},
		{"", spec.PortSet{}, ""},
		{"8080,9090", spec.PortSet{Ports: []uint16{8080, 9090}}, ""},
		{"*,80", spec.PortSet{}, `invalid -b "*,80": '*' is not allowed here`},
		{"http", spec.PortSet{}, `invalid -b "http": "http": ` + portReason},
	} {
		t.Run(tc.in, func(t *testing.T) {
			got, err := spec.ParsePortSet("-b", tc.in)
			if checkErr(t, err, "-b", tc.in, tc.err) && !reflect.DeepEqual(got, tc.want) {
				t.Errorf("ParsePortSet(%q) = %+v, want %+v", tc.in, got, tc.want)
			}
		})
	}
	if !(spec.PortSet{}).Empty() || (spec.PortSet{All: true}).Empty() || (spec.PortSet{Ports: []uint16{1}}).Empty() {
		t.Error("PortSet.Empty: want true only for no ports and no '*'")
	}
}

func TestParsePrefix(t *testing.T) {
	const notAddr = "not an IP address or CIDR"
	const notCIDR = "not a CIDR (want e.g. 10.0.0.0/8 or fd00::/8)"
	for _, tc := range []struct {
		in, want, err string
	}{
		{"10.0.0.0/8", "10.0.0.0/8", ""},
		{"10.1.2.3/8", "10.0.0.0/8", ""},
		{" 192.168.1.0/24 ", "192.168.1.0/24", ""},
		{"10.1.2.3", "10.1.2.3/32", ""},
		{"0.0.0.0/0", "0.0.0.0/0", ""},
		{"fd00::1", "fd00::1/128", ""},
		{"fd00:1:2::/48", "fd00:1:2::/48", ""},
		{"fd00::1/8", "fd00::/8", ""},
		{"::ffff:10.0.0.1", "10.0.0.1/32", ""},
		{"fe80::1%eth0", "", `invalid -i "fe80::1%eth0": ` + notAddr},
		{"10.0.0", "", `invalid -i "10.0.0": ` + notAddr},
		{"host.example", "", `invalid -i "host.example": ` + notAddr},
		{"", "", `invalid -i "": ` + notAddr},
		{"10.0.0.0/33", "", `invalid -i "10.0.0.0/33": ` + notCIDR},
		{"10.0.0.0/", "", `invalid -i "10.0.0.0/": ` + notCIDR},
		{"fd00::/129", "", `invalid -i "fd00::/129": ` + notCIDR},
		{"::ffff:10.0.0.0/104", "", `invalid -i "::ffff:10.0.0.0/104": IPv4-mapped IPv6 prefixes are not supported`},
	} {
		t.Run(tc.in, func(t *testing.T) {
			got, err := spec.ParsePrefix("-i", tc.in)
			if checkErr(t, err, "-i", tc.in, tc.err) && got != netip.MustParsePrefix(tc.want) {
				t.Errorf("ParsePrefix(%q) = %v, want %s", tc.in, got, tc.want)
			}
		})
	}
}

func TestParsePrefixList(t *testing.T) {
	const f = "traffic.sidecar.istio.io/excludeOutboundIPRanges"
	for _, tc := range []struct {
		name, in string
		want     []string
		err      string
	}{
		{"mixed families", "10.0.0.0/8, fd00::/8", []string{"10.0.0.0/8", "fd00::/8"}, ""},
		{"duplicates after masking", "10.1.0.0/8,10.0.0.0/8,10.0.0.1", []string{"10.0.0.0/8", "10.0.0.1/32"}, ""},
		{"trailing comma", "172.16.0.0/12,", []string{"172.16.0.0/12"}, ""},
		{"empty", "", nil, ""},
		{"wildcard", "*", nil, `invalid ` + f + ` "*": '*' is not allowed here`},
		{"bad item", "10.0.0.0/8,bad", nil, `invalid ` + f + ` "10.0.0.0/8,bad": "bad" is not an IP address or CIDR`},
		{"bad prefix length", "10.0.0.0/40", nil, `invalid ` + f + ` "10.0.0.0/40": "10.0.0.0/40" is not an IP address or CIDR`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := spec.ParsePrefixList(f, tc.in)
			var want []netip.Prefix
			for _, w := range tc.want {
				want = append(want, netip.MustParsePrefix(w))
			}
			if checkErr(t, err, f, tc.in, tc.err) && !reflect.DeepEqual(got, want) {
				t.Errorf("ParsePrefixList(%q) = %v, want %v", tc.in, got, want)
			}
		})
	}
	in := list(257, func(i int) string { return fmt.Sprintf("10.%d.%d.0/24", i/256, i%256) })
	_, err := spec.ParsePrefixList(f, in)
	checkErr(t, err, f, in, `invalid `+f+` "`+in+`": more than 256 prefixes`)
}

func TestParsePrefixSet(t *testing.T) {
	got, err := spec.ParsePrefixSet("-i", " * ")
	if err != nil || !got.All || len(got.Prefixes) != 0 {
		t.Errorf(`ParsePrefixSet("*") = %+v, %v; want All`, got, err)
	}
	got, err = spec.ParsePrefixSet("-i", "")
	if err != nil || !got.Empty() {
		t.Errorf(`ParsePrefixSet("") = %+v, %v; want empty`, got, err)
	}
	got, err = spec.ParsePrefixSet("-i", "fd00::/8,10.0.0.0/8,127.0.0.0/8,::1")
	if err != nil {
		t.Fatal(err)
	}
	if v4 := fmt.Sprint(got.V4()); v4 != "[10.0.0.0/8 127.0.0.0/8]" {
		t.Errorf("V4() = %s", v4)
	}
	if v6 := fmt.Sprint(got.V6()); v6 != "[fd00::/8 ::1/128]" {
		t.Errorf("V6() = %s", v6)
	}
	if !got.HasLoopback() {
		t.Error("HasLoopback() = false with 127.0.0.0/8 in the set")
	}
	if (spec.PrefixSet{Prefixes: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}}).HasLoopback() {
		t.Error("HasLoopback() = true for 10.0.0.0/8")
	}
	_, err = spec.ParsePrefixSet("-i", "*,10.0.0.0/8")
	checkErr(t, err, "-i", "*,10.0.0.0/8", `invalid -i "*,10.0.0.0/8": '*' is not allowed here`)
}

func TestParseID(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want uint32
		err  string
	}{
		{"1337", 1337, ""},
		{"0", 0, ""},
		{" 42 ", 42, ""},
		{"4294967294", 4294967294, ""},
		{"4294967295", 0, `invalid -u "4294967295": ` + idReason},
		{"4294967296", 0, `invalid -u "4294967296": ` + idReason},
		{"-1", 0, `invalid -u "-1": ` + idReason},
		{"istio", 0, `invalid -u "istio": ` + idReason},
		{"", 0, `invalid -u "": ` + idReason},
	} {
		t.Run(tc.in, func(t *testing.T) {
			got, err := spec.ParseID("-u", tc.in)
			if checkErr(t, err, "-u", tc.in, tc.err) && got != tc.want {
				t.Errorf("ParseID(%q) = %d, want %d", tc.in, got, tc.want)
			}
		})
	}
}

func TestParseIDList(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want []uint32
		err  string
	}{
		{"1337", []uint32{1337}, ""},
		{"1337, 0,1337,", []uint32{1337, 0}, ""},
		{"", nil, ""},
		{"1337,x", nil, `invalid -g "1337,x": "x": ` + idReason},
		{"1337,4294967295", nil, `invalid -g "1337,4294967295": "4294967295": ` + idReason},
	} {
		t.Run(tc.in, func(t *testing.T) {
			got, err := spec.ParseIDList("-g", tc.in)
			if checkErr(t, err, "-g", tc.in, tc.err) && !reflect.DeepEqual(got, tc.want) {
				t.Errorf("ParseIDList(%q) = %v, want %v", tc.in, got, tc.want)
			}
		})
	}
	in := list(257, func(i int) string { return fmt.Sprint(i) })
	_, err := spec.ParseIDList("-g", in)
	checkErr(t, err, "-g", in, `invalid -g "`+in+`": more than 256 IDs`)
}

func TestParseInterfaceList(t *testing.T) {
	const chars = "an interface name may only hold letters, digits and - _ . @"
	for _, tc := range []struct {
		in   string
		want []string
		err  string
	}{
		{"eth0", []string{"eth0"}, ""},
		{"eth0, tun0,eth0,", []string{"eth0", "tun0"}, ""},
		{"veth@if3,a.b-c_D", []string{"veth@if3", "a.b-c_D"}, ""},
		{"abcdefghijklmno", []string{"abcdefghijklmno"}, ""},
		{"", nil, ""},
		{"abcdefghijklmnop", nil, `invalid -c "abcdefghijklmnop": "abcdefghijklmnop": an interface name has 1 to 15 characters`},
		{"eth0,.", nil, `invalid -c "eth0,.": ".": not a valid interface name`},
		{"..", nil, `invalid -c "..": "..": not a valid interface name`},
		{"eth0;reboot", nil, `invalid -c "eth0;reboot": "eth0;reboot": ` + chars},
		{"eth 0", nil, `invalid -c "eth 0": "eth 0": ` + chars},
		{"eth/0", nil, `invalid -c "eth/0": "eth/0": ` + chars},
		{"*", nil, `invalid -c "*": "*": ` + chars},
		{"ethé", nil, `invalid -c "ethé": "ethé": ` + chars},
	} {
		t.Run(tc.in, func(t *testing.T) {
			got, err := spec.ParseInterfaceList("-c", tc.in)
			if checkErr(t, err, "-c", tc.in, tc.err) && !reflect.DeepEqual(got, tc.want) {
				t.Errorf("ParseInterfaceList(%q) = %q, want %q", tc.in, got, tc.want)
			}
		})
	}
	in := list(257, func(i int) string { return fmt.Sprintf("eth%d", i) })
	_, err := spec.ParseInterfaceList("-c", in)
	checkErr(t, err, "-c", in, `invalid -c "`+in+`": more than 256 interfaces`)
}

func TestParseGroupList(t *testing.T) {
	const f = "ISTIO_OUTBOUND_OWNER_GROUPS"
	for _, tc := range []struct {
		in   string
		want []string
		err  string
	}{
		{"java,202", []string{"java", "202"}, ""},
		{"*", nil, ""},
		{"*, java", []string{"java"}, ""},
		{"_svc,a-b.c9", []string{"_svc", "a-b.c9"}, ""},
		{"", nil, ""},
		{"9java", nil, `invalid ` + f + ` "9java": "9java": a group name starts with a letter or _`},
		{"-x", nil, `invalid ` + f + ` "-x": "-x": a group name starts with a letter or _`},
		{"4294967296", nil, `invalid ` + f + ` "4294967296": "4294967296": a group name starts with a letter or _`},
		{"a$b", nil, `invalid ` + f + ` "a$b": "a$b": a group is a GID or a name of letters, digits, -, _ and dots`},
		{"a b", nil, `invalid ` + f + ` "a b": "a b": a group is a GID or a name of letters, digits, -, _ and dots`},
		{strings.Repeat("g", 33), nil, `invalid ` + f + ` "` + strings.Repeat("g", 33) + `": "` + strings.Repeat("g", 33) + `": a group has 1 to 32 characters`},
	} {
		t.Run(tc.in, func(t *testing.T) {
			got, err := spec.ParseGroupList(f, tc.in)
			if checkErr(t, err, f, tc.in, tc.err) && !reflect.DeepEqual(got, tc.want) {
				t.Errorf("ParseGroupList(%q) = %q, want %q", tc.in, got, tc.want)
			}
		})
	}
	in := list(257, func(i int) string { return fmt.Sprintf("g%d", i) })
	_, err := spec.ParseGroupList(f, in)
	checkErr(t, err, f, in, `invalid `+f+` "`+in+`": more than 256 groups`)
}

func TestParseMode(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want spec.Mode
		err  string
	}{
		{"", spec.ModeRedirect, ""},
		{"REDIRECT", spec.ModeRedirect, ""},
		{"redirect", spec.ModeRedirect, ""},
		{" TPROXY ", spec.ModeTProxy, ""},
		{"tproxy", spec.ModeTProxy, ""},
		{"DNAT", "", `invalid -m "DNAT": interception mode must be REDIRECT or TPROXY`},
		{"TPROXY,REDIRECT", "", `invalid -m "TPROXY,REDIRECT": interception mode must be REDIRECT or TPROXY`},
	} {
		t.Run(tc.in, func(t *testing.T) {
			got, err := spec.ParseMode("-m", tc.in)
			if checkErr(t, err, "-m", tc.in, tc.err) && got != tc.want {
				t.Errorf("ParseMode(%q) = %q, want %q", tc.in, got, tc.want)
			}
		})
	}
	if spec.ModeRedirect != "REDIRECT" || spec.ModeTProxy != "TPROXY" {
		t.Errorf("mode names %q, %q; want REDIRECT, TPROXY (Istio's)", spec.ModeRedirect, spec.ModeTProxy)
	}
}

func TestParseBool(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want bool
		err  string
	}{
		{"true", true, ""},
		{" TRUE ", true, ""},
		{"1", true, ""},
		{"false", false, ""},
		{"False", false, ""},
		{"0", false, ""},
		{"yes", false, `invalid REDIRECT_DNS "yes": want true or false`},
		{"", false, `invalid REDIRECT_DNS "": want true or false`},
	} {
		t.Run(tc.in, func(t *testing.T) {
			got, err := spec.ParseBool("REDIRECT_DNS", tc.in)
			if checkErr(t, err, "REDIRECT_DNS", tc.in, tc.err) && got != tc.want {
				t.Errorf("ParseBool(%q) = %v, want %v", tc.in, got, tc.want)
			}
		})
	}
}
