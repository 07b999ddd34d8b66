package heal

import (
	"strings"
	"testing"
	"time"
)

// TestBudget: the window's bound is the smaller of MaxEvictions and the fraction
// of the node's meshed pods (at least one); the request past it opens the
// breaker (Tripped once, then BreakerOpen, also after the window passed); a
// workload's pod created after one of its pods was evicted (its replacement) is
// refused, its older pods are not; a refund gives the place back.
func TestBudget(t *testing.T) {
	t0 := time.Date(2026, 12, 3, 0, 0, 0, 0, time.UTC)
	type req struct {
		at     time.Duration
		owner  string
		meshed int
		refund bool // give it back after the answer
		want   Verdict
		born   time.Duration // the pod's creation (relative to t0; 0: long before)
	}
	for _, tt := range []struct {
		name   string
		limits Limits
		reqs   []req
		why    string // part of the breaker's reason
	}{
		{"3 per window, then the breaker", Limits{}, []req{
			{0, "a", 100, false, Allowed, 0}, {time.Minute, "b", 100, false, Allowed, 0}, {2 * time.Minute, "c", 100, false, Allowed, 0},
			{3 * time.Minute, "d", 100, false, Tripped, 0}, {4 * time.Minute, "e", 100, false, BreakerOpen, 0},
			{time.Hour, "f", 100, false, BreakerOpen, 0}, // the breaker waits for the operator, not for the window
		}, "the bound of 3 per 10m0s"},
		{"fraction of the node's meshed pods", Limits{MaxFraction: 0.2}, []req{
			{0, "a", 5, false, Allowed, 0}, {time.Second, "b", 5, false, Tripped, 0},
		}, "20% of the node's 5 meshed pods"},
		{"at least one on a small node", Limits{}, []req{
			{0, "a", 1, false, Allowed, 0}, {time.Second, "b", 1, false, Tripped, 0},
		}, "the bound of 1"},
		{"the window slides", Limits{MaxEvictions: 2, Window: time.Minute}, []req{
			{0, "a", 100, false, Allowed, 0}, {30 * time.Second, "b", 100, false, Allowed, 0},
			{61 * time.Second, "c", 100, false, Allowed, 0}, {62 * time.Second, "d", 100, false, Tripped, 0},
		}, "2 evictions within 1m0s"},
		{"the same workload again", Limits{MaxEvictions: 10}, []req{
			{at: 0, owner: "rs/web", meshed: 100, want: Allowed},
			{at: time.Second, owner: "rs/web", meshed: 100, want: Allowed},                              // another pod of the ReplicaSet, older than the eviction
			{at: time.Minute, owner: "rs/web", born: 30 * time.Second, meshed: 100, want: OwnerRepeats}, // a replacement
			{at: 2 * time.Minute, owner: "rs/api", born: 90 * time.Second, meshed: 100, want: Allowed},
		}, ""},
		{"refused by the API: refunded", Limits{MaxEvictions: 1}, []req{
			{0, "a", 100, true, Allowed, 0}, {time.Second, "a", 100, false, Allowed, 0}, {2 * time.Second, "b", 100, false, Tripped, 0},
		}, "the bound of 1"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			b := NewBudget(tt.limits)
			for i, r := range tt.reqs {
				born := t0.Add(-time.Hour)
				if r.born != 0 {
					born = t0.Add(r.born)
				}
				got, why := b.Take(t0.Add(r.at), r.owner, born, r.meshed)
				if got != r.want {
					t.Fatalf("request %d (%s at %v): %s (%s), want %s", i, r.owner, r.at, got, why, r.want)
				}
				if r.refund {
					b.Refund(r.owner)
				}
			}
			if open := b.Open(); (tt.why == "") != (open == "") || !strings.Contains(open, tt.why) {
				t.Errorf("breaker %q, want one naming %q", open, tt.why)
			}
		})
	}
}

func TestParseAction(t *testing.T) {
	for _, tt := range []struct {
		in      string
		allowed []Action
		want    Action
		err     bool
	}{
		{"repair", []Action{Repair, Evict, Report}, Repair, false},
		{"evict", []Action{Repair, Evict, Report}, Evict, false},
		{"delete", []Action{Repair, Evict, Report}, Evict, false},
		{" report ", []Action{Repair, Evict, Report}, Report, false},
		{"label", []Action{Repair, Evict, Report}, "", true},
		{"label", []Action{Repair, Evict, Label}, Label, false},
		{"", []Action{Repair}, "", true},
	} {
		got, err := ParseAction(tt.in, tt.allowed...)
		if got != tt.want || (err != nil) != tt.err {
			t.Errorf("ParseAction(%q) = %q, %v", tt.in, got, err)
		}
	}
}

func TestLimitsCheck(t *testing.T) {
	for _, tt := range []struct {
		l  Limits
		ok bool
	}{
		{Limits{}, true}, {Limits{MaxEvictions: 5, Window: time.Hour, MaxFraction: 0.5}, true},
		{Limits{MaxEvictions: -1}, false}, {Limits{Window: -time.Second}, false}, {Limits{MaxFraction: 1.5}, false},
	} {
		if err := tt.l.Check(); (err == nil) != tt.ok {
			t.Errorf("%+v: %v", tt.l, err)
		}
	}
}
