package main

import (
	"bytes"
	"os/exec"
	"strings"
	"testing"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/internal/testkit/traffic"
)

// TestRulesBadInput: malformed values exit non-zero with a message naming the
// field and the value, and change nothing in the namespace.
func TestRulesBadInput(t *testing.T) {
	testutil.RequireRoot(t)
	nft := testutil.RequireBinary(t, "nft")
	ns := testutil.NewNetns(t)
	long := strings.Repeat("1,", 300) + "1"
	cases := []struct {
		args  []string
		field string
		value string
	}{
		{[]string{"-p", "70000"}, "--envoy-port", "70000"},
		{[]string{"-z", "0"}, "--inbound-capture-port", "0"},
		{[]string{"-b", "1-2-3"}, "--istio-inbound-ports", "1-2-3"},
		{[]string{"-d", "80,abc"}, "--istio-local-exclude-ports", "80,abc"},
		{[]string{"-i", "10.0.0.0/33"}, "--istio-service-cidr", "10.0.0.0/33"},
		{[]string{"-x", "garbage"}, "--istio-service-exclude-cidr", "garbage"},
		{[]string{"-u", long}, "--proxy-uid", "more than 256"},
		{[]string{"-g", "-5"}, "--proxy-gid", "-5"},
		{[]string{"-c", "eth 0"}, "--istio-exclude-interfaces", "eth 0"},
		{[]string{"-k", "../etc"}, "--kube-virt-interfaces", "../etc"},
		{[]string{"-m", "MAGIC"}, "--istio-inbound-interception-mode", "MAGIC"},
		{[]string{"-r", "255"}, "--istio-inbound-tproxy-route-table", "255"},
		{[]string{"--backend", "ebpf"}, "backend", "ebpf"},
		{[]string{"--ipv6-mode", "pass"}, "--ipv6-mode", "pass"},
	}
	before := nftList(t, nft, ns)
	for _, c := range cases {
		t.Run(strings.Join(c.args, " "), func(t *testing.T) {
			var out, errb bytes.Buffer
			root := newRoot()
			root.SetOut(&out)
			root.SetErr(&errb)
			root.SetArgs(append([]string{"rules", "apply", "--netns", ns}, c.args...))
			err := root.Execute()
			if err == nil {
				t.Fatalf("want an error, got success: %s", out.String())
			}
			if !strings.Contains(err.Error(), c.field) || !strings.Contains(err.Error(), c.value) {
				t.Fatalf("error %q should name %s and %q", err, c.field, c.value)
			}
		})
	}
	if after := nftList(t, nft, ns); after != before {
		t.Fatalf("bad input changed the namespace:\n%s", after)
	}
}

// TestRulesIPv6: render writes IPv6 rules as istio-iptables decides from the
// namespace's addresses and --dual-stack, and as --ipv6-mode says.
func TestRulesIPv6(t *testing.T) {
	testutil.RequireRoot(t)
	dual := traffic.NewPod(t).NetNS // 10.250.0.2/24 and fd00:250::2/64
	loOnly := testutil.NewNetns(t)  // no global address
	for _, tc := range []struct {
		name     string
		netns    string
		args     []string
		want     []string
		wantNone []string
	}{
		{"dual-stack namespace, single-stack proxy", dual, nil, []string{"# IPv6: no rule"}, []string{"# ip6tables-restore"}},
		{"dual-stack namespace, --dual-stack", dual, []string{"--dual-stack"}, []string{"# ip6tables-restore", "-A ISTIO_OUTPUT -j ISTIO_REDIRECT"}, []string{"ISTIO_IPV6_DROP"}},
		{"no IPv6 address, --dual-stack", loOnly, []string{"--dual-stack"}, []string{"# IPv6: no rule"}, []string{"# ip6tables-restore"}},
		{"--ipv6-mode capture", dual, []string{"--ipv6-mode", "capture"}, []string{"# ip6tables-restore", "-A ISTIO_OUTPUT -j ISTIO_REDIRECT"}, nil},
		{"--ipv6-mode drop", dual, []string{"--ipv6-mode", "drop"}, []string{"# ip6tables-restore", "-A ISTIO_IPV6_DROP_OUT -j DROP"}, []string{"# IPv6: no rule"}},
		{"--ipv6-mode drop, --dual-stack captures", dual, []string{"--ipv6-mode", "drop", "--dual-stack"}, []string{"-A ISTIO_OUTPUT -j ISTIO_REDIRECT"}, []string{"ISTIO_IPV6_DROP"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out bytes.Buffer
			root := newRoot()
			root.SetOut(&out)
			root.SetArgs(append([]string{"rules", "render", "--netns", tc.netns, "-b", "*", "-i", "*"}, tc.args...))
			if err := root.Execute(); err != nil {
				t.Fatal(err)
			}
			v6 := out.String()
			if i := strings.Index(v6, "# ip6tables-restore"); i >= 0 {
				v6 = v6[i:]
			}
			for _, w := range tc.want {
				if !strings.Contains(v6, w) {
					t.Errorf("output lacks %q:\n%s", w, out.String())
				}
			}
			for _, w := range tc.wantNone {
				if strings.Contains(v6, w) {
					t.Errorf("output holds %q:\n%s", w, out.String())
				}
			}
		})
	}
}

func nftList(t *testing.T, nft, ns string) string {
	t.Helper()
	out, err := exec.Command("ip", "netns", "exec", ns[strings.LastIndex(ns, "/")+1:], nft, "list", "ruleset").CombinedOutput()
	if err != nil {
		t.Fatalf("nft list ruleset: %v: %s", err, out)
	}
	return string(out)
}
