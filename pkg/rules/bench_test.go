package rules_test

import (
	"testing"

	"github.com/meshcni/meshcni/pkg/rules"
	"github.com/meshcni/meshcni/pkg/rules/ipt"
	"github.com/meshcni/meshcni/pkg/spec"
)

func BenchmarkBuild(b *testing.B) {
	s := spec.PodDefaults()
	s.EnableIPv6 = true
	for b.Loop() {
		rules.Build(&s)
	}
}

func BenchmarkBuildAndRenderIptables(b *testing.B) {
	s := spec.PodDefaults()
	s.EnableIPv6 = true
	for b.Loop() {
		rs := rules.Build(&s)
		_ = ipt.Restore(rs, rules.V4)
		_ = ipt.Restore(rs, rules.V6)
	}
}

// BenchmarkBuildSingleStack: pod defaults whose IPv6 is not captured (the
// inet view's pass rules are added).
func BenchmarkBuildSingleStack(b *testing.B) {
	s := spec.PodDefaults()
	for b.Loop() {
		rules.Build(&s)
	}
}
