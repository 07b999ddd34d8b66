// Package heal is what the agent's audit and repair controller share when they
// act on a pod: the names of the actions, the one eviction path (the Eviction API,
// so PodDisruptionBudgets hold) and the node's eviction budget with its circuit
// breaker.
//
// A pod is evicted only when every guard allows it:
//   - it has a controller owner and is not a mirror (static) pod: a bare pod would
//     be gone for good, a mirror pod comes back at once; both are reported;
//   - the node's budget: at most MaxEvictions per Window and never more than
//     MaxFraction of the node's meshed pods (at least one) within the window;
//   - it is not its workload's replacement: a pod created after this agent
//     evicted a pod of the same controller owner, escaping again, is reported, not
//     evicted (the cause is not the pod);
//   - the API server admits the eviction: a 429 (a PodDisruptionBudget allows no
//     disruption now) or a 403 leaves the pod alone, logged and counted.
//
// When the budget would be exceeded the breaker opens: nothing more is evicted
// until the agent restarts (the budget lives in its memory); it reports once (a
// Warning Event on the agent's Pod, meshcni_heal_breaker_open = 1, the log, and
// Breaker for /readyz).
package heal

import (
	"fmt"
	"math"
	"strings"
	"sync"
	"time"
)

// Action is what is done about a broken or escaped pod.
type Action string

// The actions.
const (
	Repair Action = "repair" // re-apply the redirect in place
	Evict  Action = "evict"  // evict through the Eviction API; its controller recreates it
	Label  Action = "label"  // label the pod (repair controller only)
	Report Action = "report" // Event, metric, log; nothing changed
	// AliasDelete is accepted for Evict.
	AliasDelete = "delete"
)

// ParseAction parses an action name among allowed ("delete" is Evict).
func ParseAction(s string, allowed ...Action) (Action, error) {
	a := Action(strings.TrimSpace(s))
	if a == AliasDelete {
		a = Evict
	}
	for _, x := range allowed {
		if a == x {
			return a, nil
		}
	}
	names := make([]string, len(allowed))
	for i, x := range allowed {
		names[i] = string(x)
	}
	return "", fmt.Errorf("unknown action %q: want %s", s, strings.Join(names, ", "))
}

// Budget defaults.
const (
	DefaultMaxEvictions = 3
	DefaultWindow       = 10 * time.Minute
	DefaultMaxFraction  = 0.1
)

// Limits bound the evictions of one node.
type Limits struct {
	MaxEvictions int           // per Window (0: DefaultMaxEvictions)
	Window       time.Duration // (0: DefaultWindow)
	MaxFraction  float64       // of the node's meshed pods per Window (0: DefaultMaxFraction)
}

// Check rejects limits that cannot be meant.
func (l Limits) Check() error {
	switch {
	case l.MaxEvictions < 0:
		return fmt.Errorf("max evictions %d: want 1 or more", l.MaxEvictions)
	case l.Window < 0:
		return fmt.Errorf("eviction window %v: want more than 0", l.Window)
	case l.MaxFraction < 0 || l.MaxFraction > 1 || math.IsNaN(l.MaxFraction):
		return fmt.Errorf("max evict fraction %v: want more than 0, at most 1", l.MaxFraction)
	}
	return nil
}

func (l Limits) withDefaults() Limits {
	if l.MaxEvictions == 0 {
		l.MaxEvictions = DefaultMaxEvictions
	}
	if l.Window == 0 {
		l.Window = DefaultWindow
	}
	if l.MaxFraction == 0 {
		l.MaxFraction = DefaultMaxFraction
	}
	return l
}

// Verdict is the budget's answer to one eviction.
type Verdict string

// The verdicts.
const (
	Allowed      Verdict = "allowed"
	BreakerOpen  Verdict = "breaker-open"  // the breaker was open already
	Tripped      Verdict = "tripped"       // this request opened the breaker
	OwnerRepeats Verdict = "owner-repeats" // the workload was evicted before
)

// Budget is the node's eviction budget and circuit breaker. Safe for concurrent use.
type Budget struct {
	l  Limits
	mu sync.Mutex
	// at: the evictions of the window; owners: when each workload last had a pod
	// evicted.
	at     []time.Time
	owners map[string]time.Time
	open   string // why the breaker opened ("": closed)
}

// NewBudget returns a closed budget.
func NewBudget(l Limits) *Budget {
	return &Budget{l: l.withDefaults(), owners: map[string]time.Time{}}
}

// Limits are the budget's (defaults filled in).
func (b *Budget) Limits() Limits { return b.l }

// Take asks to evict one pod of owner (a workload's kind/namespace/name), created
// at created, on a node with meshed pods; Allowed counts the eviction. A pod
// created after an eviction of its workload's pod is that workload's replacement
// escaping again: OwnerRepeats. Tripped and BreakerOpen: the breaker is open,
// reason says why (Tripped only the first time).
func (b *Budget) Take(now time.Time, owner string, created time.Time, meshed int) (Verdict, string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.open != "" {
		return BreakerOpen, b.open
	}
	if at, ok := b.owners[owner]; ok && !created.Before(at) {
		return OwnerRepeats, fmt.Sprintf("workload %s had a pod evicted at %s and its pod created since escaped again: the cause is not the pod; not evicting it again", owner, at.Format(time.RFC3339))
	}
	keep := b.at[:0]
	for _, t := range b.at {
		if now.Sub(t) < b.l.Window {
			keep = append(keep, t)
		}
	}
	b.at = keep
	limit, why := b.limit(meshed)
	if len(b.at) >= limit {
		b.open = fmt.Sprintf("%d evictions within %v reached %s; the agent evicts nothing more until it restarts", len(b.at), b.l.Window, why)
		return Tripped, b.open
	}
	b.at = append(b.at, now)
	b.owners[owner] = now
	return Allowed, ""
}

// limit is the window's bound for a node with meshed pods, and what it is.
func (b *Budget) limit(meshed int) (int, string) {
	frac := int(math.Ceil(b.l.MaxFraction * float64(meshed)))
	if frac < 1 {
		frac = 1
	}
	if frac < b.l.MaxEvictions {
		return frac, fmt.Sprintf("the bound of %d (%.0f%% of the node's %d meshed pods)", frac, b.l.MaxFraction*100, meshed)
	}
	return b.l.MaxEvictions, fmt.Sprintf("the bound of %d per %v", b.l.MaxEvictions, b.l.Window)
}

// Open says why the breaker is open ("": closed).
func (b *Budget) Open() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.open
}

// Refund gives back an eviction Take allowed that did not happen (the API server
// refused it).
func (b *Budget) Refund(owner string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	delete(b.owners, owner)
	if n := len(b.at); n > 0 {
		b.at = b.at[:n-1]
	}
}
