package engine

import (
	"context"
	"fmt"
	"sort"
	"strings"

	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/policyroute"
	"github.com/meshcni/meshcni/pkg/rules"
	"github.com/meshcni/meshcni/pkg/spec"
)

// Reason names one kind of drift between a namespace's live redirect and its spec.
type Reason string

// The reasons, from the worst.
const (
	// ReasonMissingChain: a table or chain meshcni writes is gone (flushed, deleted),
	// or none of its rules is left.
	ReasonMissingChain Reason = "missing-chain"
	// ReasonChangedRule: in one of meshcni's chains, rules are missing and others
	// stand in their place.
	ReasonChangedRule Reason = "changed-rule"
	// ReasonMissingRule: rules are missing from a chain that still holds others.
	ReasonMissingRule Reason = "missing-rule"
	// ReasonForeignRule: a rule or chain meshcni did not write, in meshcni's chains
	// or tables.
	ReasonForeignRule Reason = "foreign-rule"
	// ReasonMissingRoute: the TPROXY policy rule or route is missing.
	ReasonMissingRoute Reason = "missing-route"
)

// Reasons lists every Reason.
var Reasons = []Reason{ReasonMissingChain, ReasonChangedRule, ReasonMissingRule, ReasonForeignRule, ReasonMissingRoute}

// Finding is the drift of one chain (or of the policy routing), classified.
type Finding struct {
	Reason Reason
	// Where names the chain ("<table> <chain>" for nftables, "<family> <table>
	// <chain>" for iptables) or the policy routing ("<family> route", "<family>
	// policy rule").
	Where string
	// Missing and Unexpected are the drift's entries of that place.
	Missing, Unexpected []string
}

func (f Finding) String() string {
	return fmt.Sprintf("%s in %s (%d missing, %d unexpected)", f.Reason, f.Where, len(f.Missing), len(f.Unexpected))
}

// Report is Check's drift with what it means.
type Report struct {
	backend.Drift
	// Backend is the backend whose rules were compared.
	Backend backend.Kind
	// Findings classify the drift, one per chain (or routing entry) that differs,
	// in a stable order.
	Findings []Finding
}

// Reasons lists the distinct reasons of the findings, in Reasons' order.
func (r Report) Reasons() []Reason {
	seen := map[Reason]bool{}
	for _, f := range r.Findings {
		seen[f.Reason] = true
	}
	var out []Reason
	for _, x := range Reasons {
		if seen[x] {
			out = append(out, x)
		}
	}
	return out
}

// Describe is a one-line summary of the findings ("no drift" when there are none),
// for Events and logs.
func (r Report) Describe() string {
	if len(r.Findings) == 0 {
		return "no drift"
	}
	parts := make([]string, len(r.Findings))
	for i, f := range r.Findings {
		parts[i] = f.String()
	}
	return strings.Join(parts, "; ")
}

// CheckReport is Check with the drift classified: what kind of change, where.
func CheckReport(ctx context.Context, o Options, s *spec.Spec) (Report, error) {
	if err := s.Validate(); err != nil {
		return Report{}, fmt.Errorf("invalid redirect spec: %w", err)
	}
	rs := rules.Build(s)
	b, _, err := Select(ctx, o.Backend, o.NetnsPath)
	if err != nil {
		return Report{}, err
	}
	r := Report{Backend: b.Kind()}
	r.Drift, err = b.Check(ctx, o.NetnsPath, rs)
	if err != nil {
		return r, fmt.Errorf("check rules with %s: %w", b.Kind(), err)
	}
	r.Findings = classify(r.Drift, desiredCounts(b.Kind(), rs))
	missing, err := policyroute.Check(o.NetnsPath, rs)
	if err != nil {
		return r, fmt.Errorf("check policy routing: %w", err)
	}
	r.Missing = append(r.Missing, missing...)
	for _, m := range missing {
		r.Findings = append(r.Findings, Finding{Reason: ReasonMissingRoute, Where: where(m), Missing: []string{m}})
	}
	return r, nil
}

// where is the place a drift entry names: the text before its first ": ".
func where(entry string) string {
	if i := strings.Index(entry, ": "); i >= 0 {
		return entry[:i]
	}
	return entry
}

// desiredCounts is the number of rules the ruleset puts in each iptables chain
// ("<family> <table> <chain>"), to tell a chain that lost all its rules from one
// that lost some; nil for nftables, whose drift names missing chains itself.
func desiredCounts(k backend.Kind, rs *rules.Ruleset) map[string]int {
	if k == backend.Nftables {
		return nil
	}
	n := map[string]int{}
	for _, fam := range []rules.Family{rules.V4, rules.V6} {
		for _, t := range rs.Resolve(fam) {
			for _, c := range t.Chains {
				n[fam.String()+" "+t.Name+" "+c.Name] += len(c.Rules)
			}
		}
	}
	return n
}

// classify groups the drift's entries by chain and names each chain's change.
func classify(d backend.Drift, desired map[string]int) []Finding {
	by := map[string]*Finding{}
	get := func(e string) *Finding {
		w := where(e)
		if by[w] == nil {
			by[w] = &Finding{Where: w}
		}
		return by[w]
	}
	for _, m := range d.Missing {
		f := get(m)
		f.Missing = append(f.Missing, m)
	}
	for _, u := range d.Unexpected {
		f := get(u)
		f.Unexpected = append(f.Unexpected, u)
	}
	out := make([]Finding, 0, len(by))
	for _, f := range by {
		f.Reason = reasonOf(f, desired)
		out = append(out, *f)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Where < out[j].Where })
	return out
}

func reasonOf(f *Finding, desired map[string]int) Reason {
	chainGone := false
	for _, m := range f.Missing {
		if strings.HasPrefix(m[len(f.Where):], ": chain ") {
			chainGone = true
		}
	}
	if n, ok := desired[f.Where]; ok && n > 0 && len(f.Missing) == n && len(f.Unexpected) == 0 {
		chainGone = true
	}
	switch {
	case chainGone && len(f.Unexpected) == 0:
		return ReasonMissingChain
	case len(f.Missing) > 0 && len(f.Unexpected) > 0:
		return ReasonChangedRule
	case len(f.Missing) > 0:
		return ReasonMissingRule
	}
	return ReasonForeignRule
}
