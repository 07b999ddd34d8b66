package taint

import (
	"fmt"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
)

// Event reasons of the breaker, on the node whose taint it withheld first, and on the
// node whose decision closed it.
const (
	ReasonBreakerOpen   = "TaintBreakerOpen"
	ReasonBreakerClosed = "TaintBreakerClosed"
)

// Log messages of the breaker, once per episode each.
const (
	LogBreakerOpen   = "taint breaker open: adding no taint, still removing taints as agents turn Ready"
	LogBreakerClosed = "taint breaker closed: every node due the taint fits within the limit"
)

// pendingFor is how long a taint this leader added counts as present while its cache
// does not show it yet.
const pendingFor = time.Minute

// census counts the managed nodes and those carrying the taint, from the node cache's
// events, plus the taints this leader added that the cache does not show yet.
type census struct {
	mu      sync.Mutex
	nodes   map[string]bool // managed node → carries the taint (cache)
	pending map[string]time.Time
}

func newCensus() *census {
	return &census{nodes: map[string]bool{}, pending: map[string]time.Time{}}
}

// see records a version of a node from the cache.
func (c *census) see(n *corev1.Node) {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := HasTaint(n)
	c.nodes[n.Name] = t
	if t {
		delete(c.pending, n.Name)
	}
}

// forget records a node gone from the cache.
func (c *census) forget(name string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.nodes, name)
	delete(c.pending, name)
}

// added records a taint this leader wrote at now; removed one it took off.
func (c *census) added(name string, now time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.pending[name] = now
}

func (c *census) removed(name string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.pending, name)
}

// count returns the managed nodes and those carrying the taint at now.
func (c *census) count(now time.Time) (managed, tainted int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for name, at := range c.pending {
		if now.Sub(at) > pendingFor {
			delete(c.pending, name)
		}
	}
	for name, t := range c.nodes {
		if _, p := c.pending[name]; t || p {
			tainted++
		}
	}
	return len(c.nodes), tainted
}

// breaker is the leader's record of the taints it withheld because they would pass the
// limit. It is open while any is withheld.
type breaker struct {
	mu        sync.Mutex
	withheld  map[string]bool
	openSince time.Time
	// The figures when it last opened, or last decided while open.
	managed, tainted, limit int
}

func newBreaker() *breaker { return &breaker{withheld: map[string]bool{}} }

// BreakerState is the breaker as a report says it.
type BreakerState struct {
	Open                    bool
	Since                   time.Time
	Withheld                int
	Managed, Tainted, Limit int
}

func (s BreakerState) String() string {
	if !s.Open {
		return "taint breaker closed"
	}
	return fmt.Sprintf("taint breaker open since %s: %d nodes carry the taint, %d more are due it, limit %d of %d managed nodes",
		s.Since.UTC().Format(time.RFC3339), s.Tainted, s.Withheld, s.Limit, s.Managed)
}

func (b *breaker) state() BreakerState {
	b.mu.Lock()
	defer b.mu.Unlock()
	return BreakerState{Open: !b.openSince.IsZero(), Since: b.openSince, Withheld: len(b.withheld),
		Managed: b.managed, Tainted: b.tainted, Limit: b.limit}
}

// reset forgets everything (a new leading term).
func (b *breaker) reset() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.withheld, b.openSince = map[string]bool{}, time.Time{}
}

// ask decides whether node may get the taint, and records the answer: opened and
// closed say the breaker opened or closed with it.
func (b *breaker) ask(node string, managed, tainted, limit int, now time.Time) (admit, opened, closed bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	wanting := len(b.withheld) + 1
	if b.withheld[node] {
		wanting--
	}
	b.managed, b.tainted, b.limit = managed, tainted, limit
	if Admit(tainted, wanting, limit) {
		delete(b.withheld, node)
		if !b.openSince.IsZero() && len(b.withheld) == 0 {
			b.openSince = time.Time{}
			return true, false, true
		}
		return true, false, false
	}
	b.withheld[node] = true
	if b.openSince.IsZero() {
		b.openSince = now
		return false, true, false
	}
	return false, false, false
}

// settle records that node is not due the taint (its decision was no add, or it is
// gone). closed says the breaker closed with it; retry lists the withheld nodes to
// decide again, because they fit within the limit now.
func (b *breaker) settle(node string, managed, tainted, limit int) (closed bool, retry []string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	delete(b.withheld, node)
	if b.openSince.IsZero() {
		return false, nil
	}
	b.managed, b.tainted, b.limit = managed, tainted, limit
	if len(b.withheld) == 0 {
		b.openSince = time.Time{}
		return true, nil
	}
	if Admit(tainted, len(b.withheld), limit) {
		for n := range b.withheld {
			retry = append(retry, n)
		}
	}
	return false, retry
}

// isOpen reports whether the breaker is open.
func (b *breaker) isOpen() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return !b.openSince.IsZero()
}
