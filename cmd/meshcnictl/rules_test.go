package main

import (
	"bytes"
	"os/exec"
	"strings"
	"testing"

	"github.com/meshcni/meshcni/internal/testutil"
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

func nftList(t *testing.T, nft, ns string) string {
	t.Helper()
	out, err := exec.Command("ip", "netns", "exec", ns[strings.LastIndex(ns, "/")+1:], nft, "list", "ruleset").CombinedOutput()
	if err != nil {
		t.Fatalf("nft list ruleset: %v: %s", err, out)
	}
	return string(out)
}
