package iptables

import (
	"sync"
	"testing"
)

func TestOwnedBuiltinRule(t *testing.T) {
	for _, tc := range []struct {
		spec string
		want bool
	}{
		{"-p tcp -j ISTIO_INBOUND", true},
		{"-j ISTIO_OUTPUT", true},
		{"-p udp --dport 53 -j ISTIO_OUTPUT_DNS", true},
		{"-i eth1 -j RETURN", true},
		{"-o veth-j -j RETURN", true},
		{"-i cni@0.1_x -j RETURN", true},
		{"-p tcp -m mark --mark 0x539 -j CONNMARK --save-mark", true},
		{"-p tcp -m mark --mark 0x539 -j CONNMARK --save-mark --nfmask 0xffffffff --ctmask 0xffffffff", true},
		{"-o lo -p tcp -m mark --mark 0x539 -j RETURN", true},
		{"! -d 127.0.0.1/32 -o lo -p tcp -m owner --uid-owner 1337 -j MARK --set-xmark 0x53a/0xffffffff", true},
		{"! -d ::1/128 -o lo -p tcp -m owner --gid-owner 1337 -j MARK --set-xmark 0x53a/0xffffffff", true},
		{"-p tcp -m connmark --mark 0x539 -j CONNMARK --restore-mark", true},
		{"-p tcp -m connmark --mark 0x539 -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff", true},

		{"", false},
		{"-p tcp", false},
		{"-j KUBE-SERVICES", false},
		{"-p tcp -j DNAT --to-destination 10.0.0.1:80", false},
		{"-j ISTIO_FOO", false},
		{"-i eth1 -j ACCEPT", false},
		{"-i eth1 -p tcp -j RETURN", false},
		{"-s 10.0.0.0/8 -j RETURN", false},
		{"-p tcp -m mark --mark 0x539 -j CONNMARK --save-mark --nfmask 0xff", false},
		{"-p udp -m mark --mark 0x539 -j CONNMARK --save-mark", false},
		{"! -d 127.0.0.1/32 -o lo -p tcp -m owner --uid-owner 1337 -j MARK --set-xmark 0x1/0xffffffff", false},
		{"-j MARK --set-xmark 0x53a/0xffffffff", false},
		{"-p tcp -m connmark --mark 0x539 -j CONNMARK --restore-mark -j RETURN", false},
	} {
		if got := ownedBuiltinRule(tc.spec); got != tc.want {
			t.Errorf("ownedBuiltinRule(%q) = %v, want %v", tc.spec, got, tc.want)
		}
	}
}

// A kernel chain's rule with another target is judged without compiling the shapes.
func TestOwnedBuiltinRuleForeignTargetsCompileNothing(t *testing.T) {
	ownedShapesOnce, ownedShapes = sync.Once{}, nil // as in a fresh plugin process
	for _, spec := range []string{"-j KUBE-SERVICES", "-p tcp -j DNAT --to-destination 10.0.0.1:80", "-p tcp -j ISTIO_INBOUND", "-i eth0 -j ACCEPT"} {
		ownedBuiltinRule(spec)
	}
	if ownedShapes != nil {
		t.Error("shapes compiled for rules whose targets no shape has")
	}
}
