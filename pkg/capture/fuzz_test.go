package capture

import (
	"errors"
	"strings"
	"testing"

	"github.com/meshcni/meshcni/pkg/rules"
	"github.com/meshcni/meshcni/pkg/rules/ipt"
	"github.com/meshcni/meshcni/pkg/rules/nft"
	"github.com/meshcni/meshcni/pkg/spec"
)

// fuzzAnnotations are the annotations FuzzSpec sets, in the order of its arguments.
var fuzzAnnotations = []string{
	AnnotationInterceptionMode,
	AnnotationIncludeInboundPorts,
	AnnotationExcludeInboundPorts,
	AnnotationIncludeOutboundPorts,
	AnnotationExcludeOutboundPorts,
	AnnotationIncludeOutboundIPRanges,
	AnnotationExcludeOutboundIPRanges,
	AnnotationExcludeInterfaces,
	AnnotationRerouteVirtualInterfaces,
	AnnotationKubevirtInterfaces,
}

// checkLines fails unless every line of script starts with one of prefixes and no
// line holds a control character (a value that smuggled a line break or a NUL).
func checkLines(t *testing.T, what, script string, prefixes ...string) {
	t.Helper()
	if script != "" && !strings.HasSuffix(script, "\n") {
		t.Fatalf("%s does not end with a newline:\n%s", what, script)
	}
	for _, line := range strings.Split(strings.TrimSuffix(script, "\n"), "\n") {
		if strings.IndexFunc(line, func(r rune) bool { return r < 0x20 || r == 0x7f }) >= 0 {
			t.Fatalf("%s: line %q holds a control character", what, line)
		}
		ok := false
		for _, p := range prefixes {
			ok = ok || strings.HasPrefix(line, p)
		}
		if !ok && script != "" {
			t.Fatalf("%s: injected line %q", what, line)
		}
	}
}

// FuzzSpec fuzzes a meshed pod's annotations (present when their bit in mask is
// set; bit 10 sets meshcni.io/ipv6 to dual's value), the proxy's
// runAsUser/runAsGroup and its DNS/dual-stack environment. An
// accepted pod yields a spec that passes Validate and renders, for iptables, only
// `*table`, `:chain`, `-A`/`-I`/`-N` and COMMIT lines, and for nftables only
// `add …`/`delete …` lines; a rejected one is a *spec.FieldError naming the
// annotation (or securityContext field) that was set.
func FuzzSpec(f *testing.F) {
	f.Add(uint16(0), "", "", "", "", "", "", "", "", "", "", int64(0), int64(0), "")
	f.Add(uint16(0x3ff), "TPROXY", "*", "15020", "443,80", "", "10.0.0.0/8,fd00::/8", "10.1.2.3/32", "eth1", "net1,net2", "kv0", int64(1337), int64(1337), "true")
	f.Add(uint16(0x3ff), "redirect", "80, 8080,", "0", "", "0,9090", "*", "", "", "", "", int64(1000), int64(-1), "1")
	f.Add(uint16(0x2), "", "80\n-A OUTPUT -j ACCEPT", "", "", "", "", "", "", "", "", int64(0), int64(0), "")
	f.Add(uint16(0x80), "", "", "", "", "", "", "", "eth0\nCOMMIT", "", "", int64(0), int64(0), "")
	f.Add(uint16(0x40), "", "", "", "", "", "", "*", "", "", "", int64(0), int64(0), "")
	f.Add(uint16(0x1), "NONE", "", "", "", "", "", "", "", "", "", int64(4294967295), int64(0), "false")
	f.Add(uint16(0x401), "TPROXY", "", "", "", "", "", "", "", "", "", int64(0), int64(0), "drop")
	f.Add(uint16(0x400), "", "", "", "", "", "", "", "", "", "", int64(0), int64(0), "capture\n")
	f.Fuzz(func(t *testing.T, mask uint16, mode, inInc, inExc, outInc, outExc, ipInc, ipExc, exclIf, reroute, kubevirt string, uid, gid int64, dual string) {
		values := []string{mode, inInc, inExc, outInc, outExc, ipInc, ipExc, exclIf, reroute, kubevirt}
		pod := meshedPod(env(EnvDualStack, dual), env(EnvDNSCapture, dual), runAs(&uid, &gid))
		set := map[string]bool{}
		for i, v := range values {
			if mask&(1<<i) != 0 {
				pod.Annotations[fuzzAnnotations[i]] = v
				set[fuzzAnnotations[i]] = true
			}
		}
		if mask&(1<<len(values)) != 0 {
			pod.Annotations[AnnotationIPv6] = dual
			set[AnnotationIPv6] = true
		}
		set[ProxyContainer+".securityContext.runAsUser"] = true
		set[ProxyContainer+".securityContext.runAsGroup"] = true
		d := Decide(pod, Config{})
		if d.Captured() == strings.EqualFold(strings.TrimSpace(pod.Annotations[AnnotationInterceptionMode]), "NONE") {
			t.Fatalf("Decide = %+v with interception mode %q", d, pod.Annotations[AnnotationInterceptionMode])
		}
		s, err := Spec(pod)
		if err != nil {
			var fe *spec.FieldError
			if !errors.As(err, &fe) || !set[fe.Field] {
				t.Fatalf("Spec: error %v names no field that was set", err)
			}
			return
		}
		if err := s.Validate(); err != nil {
			t.Fatalf("accepted spec does not validate: %v", err)
		}
		for _, v6 := range []bool{true, false} { // IPv6 captured; IPv6 as the mode says
			s.EnableIPv4, s.EnableIPv6 = true, v6
			rs := rules.Build(s)
			for _, fam := range []rules.Family{rules.V4, rules.V6} {
				checkLines(t, "iptables-restore "+fam.String(), ipt.Restore(rs, fam), "*", ":", "-A ", "-I ", "-N ", "COMMIT")
			}
			checkLines(t, "nft script", nft.Render(rs), "add ", "delete ", "flush ")
		}
	})
}
