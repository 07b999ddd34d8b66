package taint

import (
	"context"
	"sync"
	"time"

	"k8s.io/client-go/tools/leaderelection/resourcelock"
)

// fence says whether this replica may write to a node now: only within --renew-deadline
// of sending a renewal of the Lease that the other replicas count as one. It is read on
// this process's monotonic clock, so a process that was paused (SIGSTOP, a frozen VM) or
// cut off from the API server finds it lapsed when it runs again, whatever client-go's
// elector, which only notices a lost Lease on its next try to renew (up to
// --renew-deadline later), believes meanwhile.
//
// Why --renew-deadline from the send: another replica takes over once it has seen the
// Lease record unchanged for its leaseDurationSeconds (whole seconds) on its own clock,
// counted from when it saw the record change, which is after the API server stored the
// renewal, which is after this replica sent it. client-go compares records by their
// JSON, whose times are whole seconds, so a renewal in the same second as the one
// before is no change to the others: the fence counts from the first renewal sent with
// the current record's second. Validate keeps --renew-deadline below the whole-second
// lease duration, so a write allowed by the fence is sent at least lease duration −
// renew deadline before any other replica can lead.
type fence struct {
	identity string
	validFor time.Duration
	now      func() time.Time

	mu        sync.Mutex
	until     time.Time // writes are allowed before this (monotonic reading)
	second    int64     // RenewTime of the last renewal, in Unix seconds
	firstSent time.Time // when the first renewal with that RenewTime was sent
	changed   chan struct{}
}

func newFence(identity string, validFor time.Duration) *fence {
	return &fence{identity: identity, validFor: validFor, now: time.Now, changed: make(chan struct{})}
}

// renewed records a renewal sent at sent and stored by the API server.
func (f *fence) renewed(renewTime time.Time, sent time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if s := renewTime.Unix(); s != f.second || f.firstSent.IsZero() {
		f.second, f.firstSent = s, sent
	}
	f.until = f.firstSent.Add(f.validFor)
	close(f.changed)
	f.changed = make(chan struct{})
}

// revoke forbids writes until the next renewal (the Lease is being released).
func (f *fence) revoke() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.until, f.second, f.firstSent = time.Time{}, 0, time.Time{}
}

// lapsed reports whether writes are not allowed now, and since when.
func (f *fence) lapsed() (bool, time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return !f.now().Before(f.until), f.until
}

// hold waits until writes are allowed and returns a context for one write that ends
// when they stop being allowed; or ctx's error if ctx ends first (leadership ended).
func (f *fence) hold(ctx context.Context) (context.Context, context.CancelFunc, error) {
	for {
		f.mu.Lock()
		until, changed := f.until, f.changed
		f.mu.Unlock()
		if f.now().Before(until) {
			wctx, cancel := context.WithDeadline(ctx, until)
			return wctx, cancel, nil
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return nil, nil, ctx.Err()
		}
	}
}

// fencedLock is the Lease lock of the elector, telling the fence about every renewal.
type fencedLock struct {
	resourcelock.Interface
	f *fence
}

func (l fencedLock) Create(ctx context.Context, ler resourcelock.LeaderElectionRecord) error {
	return l.track(ler, func() error { return l.Interface.Create(ctx, ler) })
}

func (l fencedLock) Update(ctx context.Context, ler resourcelock.LeaderElectionRecord) error {
	return l.track(ler, func() error { return l.Interface.Update(ctx, ler) })
}

func (l fencedLock) track(ler resourcelock.LeaderElectionRecord, write func() error) error {
	if ler.HolderIdentity != l.f.identity { // a release
		l.f.revoke()
		return write()
	}
	sent := l.f.now()
	if err := write(); err != nil {
		return err
	}
	l.f.renewed(ler.RenewTime.Time, sent)
	return nil
}
