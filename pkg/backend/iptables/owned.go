package iptables

import (
	"regexp"
	"strings"
	"sync"
)

// meshcni (and Istio) own the chains named ISTIO_*. In the kernel's own chains
// (PREROUTING, OUTPUT) a rule is meshcni's when it jumps to an owned chain or has
// the exact shape of one of the few non-jump rules the rules builder writes there
// (see pkg/rules: excluded/virtual interfaces, TPROXY marks). Anything else is
// someone else's and is never touched.
func ownedChain(name string) bool {
	switch name {
	case "ISTIO_INBOUND", "ISTIO_REDIRECT", "ISTIO_IN_REDIRECT", "ISTIO_OUTPUT", "ISTIO_OUTPUT_DNS",
		"ISTIO_DIVERT", "ISTIO_TPROXY", "ISTIO_DROP", "ISTIO_IPV6_DROP_IN", "ISTIO_IPV6_DROP_OUT":
		return true
	}
	return false
}

// ownedBuiltinShapes is compiled on first use, not at package init: the CNI plugin
// links this package and starts once per pod, and most of its runs never need it
// (compiling at init would be paid by every start). A sync.Once rather than a
// package-level sync.OnceValue, whose closure is allocated at init.
func ownedBuiltinShapes() []*regexp.Regexp {
	ownedShapesOnce.Do(compileOwnedShapes)
	return ownedShapes
}

var (
	ownedShapesOnce sync.Once
	ownedShapes     []*regexp.Regexp
)

func compileOwnedShapes() {
	ownedShapes = []*regexp.Regexp{
		// interface short-circuits: -i X -j RETURN / -o X -j RETURN
		regexp.MustCompile(`^-[io] [A-Za-z0-9_.@-]+ -j RETURN$`),
		// TPROXY: save the proxy's mark on the connection
		regexp.MustCompile(`^-p tcp -m mark --mark 0x[0-9a-f]+ -j CONNMARK --save-mark( --nfmask 0xffffffff --ctmask 0xffffffff)?$`),
		// TPROXY: marked loopback traffic returns
		regexp.MustCompile(`^-o lo -p tcp -m mark --mark 0x[0-9a-f]+ -j RETURN$`),
		// TPROXY: the proxy's loopback traffic to the workload is marked 1338
		regexp.MustCompile(`^! -d [0-9a-f.:]+/\d+ -o lo -p tcp -m owner --(uid|gid)-owner \d+ -j MARK --set-xmark 0x53a/0xffffffff$`),
		// TPROXY: restore the connection mark
		regexp.MustCompile(`^-p tcp -m connmark --mark 0x[0-9a-f]+ -j CONNMARK --restore-mark( --nfmask 0xffffffff --ctmask 0xffffffff)?$`),
	}
}

func ownedBuiltinRule(spec string) bool {
	i := strings.LastIndex(spec, "-j ")
	if i < 0 {
		return false // every owned shape jumps
	}
	target, _, _ := strings.Cut(spec[i+3:], " ")
	switch {
	case ownedChain(target):
		return true
	case target != "RETURN" && target != "CONNMARK" && target != "MARK":
		// The shapes' targets (nothing after them contains "-j "): any other
		// rule, such as another CNI's, is not ours without compiling the shapes.
		return false
	}
	for _, re := range ownedBuiltinShapes() {
		if re.MatchString(spec) {
			return true
		}
	}
	return false
}
