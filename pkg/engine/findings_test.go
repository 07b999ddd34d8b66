package engine

import (
	"reflect"
	"testing"

	"github.com/meshcni/meshcni/pkg/backend"
)

// TestClassify: each chain's drift is named by what happened to it; the expected
// reasons are written from the definitions, not from the code.
func TestClassify(t *testing.T) {
	for _, tc := range []struct {
		name    string
		drift   backend.Drift
		desired map[string]int
		want    map[string]Reason
	}{
		{"nftables chain deleted", backend.Drift{Missing: []string{
			"istio-proxy-nat istio-output: chain (regular)", "istio-proxy-nat istio-output: counter jump istio-redirect"}},
			nil, map[string]Reason{"istio-proxy-nat istio-output": ReasonMissingChain}},
		{"nftables rule replaced", backend.Drift{
			Missing:    []string{"istio-proxy-nat istio-redirect: meta l4proto tcp redirect to :15001"},
			Unexpected: []string{"istio-proxy-nat istio-redirect: meta l4proto tcp redirect to :15999"}},
			nil, map[string]Reason{"istio-proxy-nat istio-redirect": ReasonChangedRule}},
		{"foreign rule", backend.Drift{Unexpected: []string{"istio-proxy-nat istio-output: ip daddr 10.250.0.1 return"}},
			nil, map[string]Reason{"istio-proxy-nat istio-output": ReasonForeignRule}},
		{"iptables chain emptied", backend.Drift{Missing: []string{
			"ipv4 nat ISTIO_REDIRECT: -A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001"}},
			map[string]int{"ipv4 nat ISTIO_REDIRECT": 1, "ipv4 nat ISTIO_OUTPUT": 11},
			map[string]Reason{"ipv4 nat ISTIO_REDIRECT": ReasonMissingChain}},
		{"iptables one rule of many gone", backend.Drift{Missing: []string{"ipv4 nat ISTIO_OUTPUT: -A ISTIO_OUTPUT -o lo -j RETURN"}},
			map[string]int{"ipv4 nat ISTIO_OUTPUT": 11}, map[string]Reason{"ipv4 nat ISTIO_OUTPUT": ReasonMissingRule}},
		{"two chains", backend.Drift{
			Missing:    []string{"ipv4 nat ISTIO_OUTPUT: -A ISTIO_OUTPUT -o lo -j RETURN"},
			Unexpected: []string{"ipv4 nat ISTIO_INBOUND: -A ISTIO_INBOUND -j ACCEPT"}},
			map[string]int{"ipv4 nat ISTIO_OUTPUT": 11, "ipv4 nat ISTIO_INBOUND": 5},
			map[string]Reason{"ipv4 nat ISTIO_OUTPUT": ReasonMissingRule, "ipv4 nat ISTIO_INBOUND": ReasonForeignRule}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := map[string]Reason{}
			for _, f := range classify(tc.drift, tc.desired) {
				got[f.Where] = f.Reason
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("got %v, want %v", got, tc.want)
			}
		})
	}
}

func TestReportReasons(t *testing.T) {
	r := Report{Findings: []Finding{{Reason: ReasonForeignRule}, {Reason: ReasonMissingRoute}, {Reason: ReasonMissingChain}, {Reason: ReasonForeignRule}}}
	if got := r.Reasons(); !reflect.DeepEqual(got, []Reason{ReasonMissingChain, ReasonForeignRule, ReasonMissingRoute}) {
		t.Fatal(got)
	}
	if (Report{}).Describe() != "no drift" {
		t.Fatal("empty report")
	}
}
