package ipt_test

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/meshcni/meshcni/internal/testkit/conformance"
	"github.com/meshcni/meshcni/internal/testkit/golden"
	"github.com/meshcni/meshcni/internal/testkit/specfixtures"
	"github.com/meshcni/meshcni/pkg/rules"
	"github.com/meshcni/meshcni/pkg/rules/ipt"
	"github.com/meshcni/meshcni/pkg/spec"
)

// checkFamilies compares the iptables-restore payloads of an enabled family with
// <base>-v4.iptables / <base>-v6.iptables; a disabled family must render nothing.
// IPv6 is enabled when captured, and with IPv6 mode drop (its drop chains).
func checkFamilies(t *testing.T, dir *golden.Dir, base string, s *spec.Spec) {
	t.Helper()
	rs := rules.Build(s)
	for _, f := range []struct {
		family  rules.Family
		enabled bool
		suffix  string
	}{{rules.V4, s.EnableIPv4, "-v4.iptables"}, {rules.V6, s.IPv6Captured() || s.IPv6 == spec.IPv6Drop, "-v6.iptables"}} {
		got := ipt.Restore(rs, f.family)
		if !f.enabled {
			if got != "" {
				t.Errorf("%s is disabled, yet Restore(%s) renders:\n%s", f.family, f.family, got)
			}
			continue
		}
		dir.CheckString(t, base+f.suffix, got)
	}
}

// TestRestoreGolden renders the shared spec table (internal/testkit/specfixtures) into
// testdata/specs/<name>-v{4,6}.iptables.
func TestRestoreGolden(t *testing.T) {
	dir := golden.Open(t, "testdata/specs")
	for _, f := range specfixtures.All() {
		t.Run(f.Name, func(t *testing.T) {
			if err := f.Spec.Validate(); err != nil {
				t.Fatal(err)
			}
			checkFamilies(t, dir, f.Name, f.Spec)
		})
	}
}

// TestRestoreConformanceCasesGolden renders Istio's iptables conformance cases into
// testdata/istio/<case>-v{4,6}.iptables, to read beside Istio's own golden files.
func TestRestoreConformanceCasesGolden(t *testing.T) {
	cases := conformance.Cases(t, "iptables")
	dir := golden.Open(t, "testdata/istio")
	for _, c := range cases {
		t.Run(c.Name, func(t *testing.T) {
			s, err := c.Spec()
			if err != nil {
				t.Fatal(err)
			}
			checkFamilies(t, dir, c.Name, s)
		})
	}
}

func TestRestoreLayout(t *testing.T) {
	s := spec.PodDefaults()
	s.Mode = spec.ModeTProxy
	s.RedirectDNS, s.CaptureAllDNS = true, true
	got := ipt.Restore(rules.Build(&s), rules.V4)
	var headers []string
	for _, line := range strings.Split(got, "\n") {
		if strings.HasPrefix(line, "*") || line == "COMMIT" {
			headers = append(headers, line)
		}
		if line == ":PREROUTING - [0:0]" || line == ":OUTPUT - [0:0]" {
			t.Errorf("built-in chain declared: %q", line)
		}
	}
	want := "*mangle COMMIT *nat COMMIT *raw COMMIT"
	if strings.Join(headers, " ") != want {
		t.Errorf("tables %q, want %q", strings.Join(headers, " "), want)
	}
	for _, decl := range []string{":ISTIO_INBOUND - [0:0]", ":ISTIO_DIVERT - [0:0]", ":ISTIO_TPROXY - [0:0]", ":ISTIO_REDIRECT - [0:0]",
		":ISTIO_IN_REDIRECT - [0:0]", ":ISTIO_OUTPUT - [0:0]", ":ISTIO_OUTPUT_DNS - [0:0]"} {
		if !strings.Contains(got, "\n"+decl+"\n") {
			t.Errorf("missing chain declaration %q", decl)
		}
	}
}

func TestRuleArgs(t *testing.T) {
	uid := uint32(1337)
	tcp53 := rules.PortMatch{Ports: []uint16{53}}
	for _, tc := range []struct {
		name string
		rule rules.Rule
		want string
	}{
		{"return", rules.Rule{Verdict: rules.Verdict{Kind: rules.Return}}, "-j RETURN"},
		{"accept", rules.Rule{Verdict: rules.Verdict{Kind: rules.Accept}}, "-j ACCEPT"},
		{"drop", rules.Rule{Verdict: rules.Verdict{Kind: rules.Drop}}, "-j DROP"},
		{"jump", rules.Rule{Verdict: rules.Verdict{Kind: rules.Jump, Chain: "ISTIO_OUTPUT"}}, "-j ISTIO_OUTPUT"},
		{"redirect", rules.Rule{Match: rules.Match{Proto: rules.TCP}, Verdict: rules.Verdict{Kind: rules.Redirect, Port: 15001}},
			"-p tcp -j REDIRECT --to-ports 15001"},
		{"tproxy", rules.Rule{Match: rules.Match{Proto: rules.TCP, Dst: rules.PrefixMatch{Prefix: netip.MustParsePrefix("127.0.0.1/32"), Neg: true}},
			Verdict: rules.Verdict{Kind: rules.TProxy, Port: 15006, Mark: 1337}},
			"! -d 127.0.0.1/32 -p tcp -j TPROXY --tproxy-mark 1337/0xffffffff --on-port 15006"},
		{"set-mark", rules.Rule{Verdict: rules.Verdict{Kind: rules.SetMark, Mark: 1338}}, "-j MARK --set-mark 1338"},
		{"save-mark", rules.Rule{Match: rules.Match{Proto: rules.TCP, Mark: &rules.MarkMatch{Value: 1337}}, Verdict: rules.Verdict{Kind: rules.SaveMark}},
			"-p tcp -m mark --mark 1337 -j CONNMARK --save-mark"},
		{"restore-mark", rules.Rule{Match: rules.Match{Proto: rules.TCP, ConnMark: &rules.MarkMatch{Value: 1337}}, Verdict: rules.Verdict{Kind: rules.RestoreMark}},
			"-p tcp -m connmark --mark 1337 -j CONNMARK --restore-mark"},
		{"ct-zone", rules.Rule{Match: rules.Match{Proto: rules.UDP, DPorts: tcp53, Owners: []rules.OwnerMatch{{UID: &uid}}}, Verdict: rules.Verdict{Kind: rules.CTZone, Zone: 1}},
			"-p udp --dport 53 -m owner --uid-owner 1337 -j CT --zone 1"},
		{"lo-to-inbound", rules.Rule{Match: rules.Match{Proto: rules.TCP, Out: rules.IfaceMatch{Name: "lo"},
			Dst: rules.PrefixMatch{Prefix: netip.MustParsePrefix("127.0.0.1/32"), Neg: true}, DPorts: rules.PortMatch{Ports: []uint16{53, 15008}, Neg: true},
			Owners: []rules.OwnerMatch{{UID: &uid}}}, Verdict: rules.Verdict{Kind: rules.Jump, Chain: "ISTIO_IN_REDIRECT"}},
			"! -d 127.0.0.1/32 -o lo -p tcp -m multiport ! --dports 53,15008 -m owner --uid-owner 1337 -j ISTIO_IN_REDIRECT"},
		{"not-gid", rules.Rule{Match: rules.Match{Out: rules.IfaceMatch{Name: "lo"}, Owners: []rules.OwnerMatch{{Group: "1337", Neg: true}}}, Verdict: rules.Verdict{Kind: rules.Return}},
			"-o lo -m owner ! --gid-owner 1337 -j RETURN"},
		{"group-names", rules.Rule{Match: rules.Match{Owners: []rules.OwnerMatch{{Group: "java", Neg: true}, {Group: "202", Neg: true}}}, Verdict: rules.Verdict{Kind: rules.Return}},
			"-m owner ! --gid-owner java -m owner ! --gid-owner 202 -j RETURN"},
		{"source-v6", rules.Rule{Match: rules.Match{Src: rules.PrefixMatch{Prefix: netip.MustParsePrefix("::6/128")}, Out: rules.IfaceMatch{Name: "lo"}}, Verdict: rules.Verdict{Kind: rules.Return}},
			"-s ::6/128 -o lo -j RETURN"},
		{"in-iface", rules.Rule{Match: rules.Match{In: rules.IfaceMatch{Name: "eth1"}}, Verdict: rules.Verdict{Kind: rules.Return}}, "-i eth1 -j RETURN"},
		{"not-in-iface", rules.Rule{Match: rules.Match{In: rules.IfaceMatch{Name: "eth1", Neg: true}}, Verdict: rules.Verdict{Kind: rules.Return}}, "! -i eth1 -j RETURN"},
		{"sport", rules.Rule{Match: rules.Match{Proto: rules.UDP, SPorts: rules.PortMatch{Ports: []uint16{15053}}}, Verdict: rules.Verdict{Kind: rules.CTZone, Zone: 2}},
			"-p udp --sport 15053 -j CT --zone 2"},
		{"sports", rules.Rule{Match: rules.Match{Proto: rules.UDP, SPorts: rules.PortMatch{Ports: []uint16{53, 5353}}}, Verdict: rules.Verdict{Kind: rules.Return}},
			"-p udp -m multiport --sports 53,5353 -j RETURN"},
		{"not-mark", rules.Rule{Match: rules.Match{Proto: rules.TCP, In: rules.IfaceMatch{Name: "lo"}, Mark: &rules.MarkMatch{Value: 1338, Neg: true}}, Verdict: rules.Verdict{Kind: rules.Return}},
			"-i lo -p tcp -m mark ! --mark 1338 -j RETURN"},
		{"ctstate", rules.Rule{Match: rules.Match{Proto: rules.TCP, CTState: rules.CTEstablished | rules.CTRelated}, Verdict: rules.Verdict{Kind: rules.Jump, Chain: "ISTIO_DIVERT"}},
			"-p tcp -m conntrack --ctstate RELATED,ESTABLISHED -j ISTIO_DIVERT"},
		{"invalid", rules.Rule{Match: rules.Match{CTState: rules.CTInvalid}, Verdict: rules.Verdict{Kind: rules.Jump, Chain: "ISTIO_DROP"}},
			"-m conntrack --ctstate INVALID -j ISTIO_DROP"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := strings.Join(ipt.RuleArgs(tc.rule), " "); got != tc.want {
				t.Errorf("got  %s\nwant %s", got, tc.want)
			}
		})
	}
}

func TestRuleArgsUnknownVerdictPanics(t *testing.T) {
	defer func() {
		if recover() == nil {
			t.Error("a rule without a verdict rendered; want a panic")
		}
	}()
	ipt.RuleArgs(rules.Rule{})
}
