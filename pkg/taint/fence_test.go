package taint

import (
	"context"
	"errors"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
)

// TestFenceCountsFromTheFirstRenewalOfASecond: the other replicas tell renewals apart
// by the record's whole-second times, so a renewal in the same second as the one
// before does not move the fence; one in a new second does, from when it was sent.
func TestFenceCountsFromTheFirstRenewalOfASecond(t *testing.T) {
	base := time.Date(2026, 1, 1, 0, 0, 10, 0, time.UTC)
	now := base
	f := newFence("me", 2*time.Second)
	f.now = func() time.Time { return now }
	if lapsed, _ := f.lapsed(); !lapsed {
		t.Fatal("a fence never renewed allows writes")
	}
	for _, tc := range []struct {
		sent, renewTime time.Duration // after base
		until           time.Duration // after base
	}{
		{sent: 50 * time.Millisecond, renewTime: 50 * time.Millisecond, until: 2050 * time.Millisecond},
		{sent: 560 * time.Millisecond, renewTime: 560 * time.Millisecond, until: 2050 * time.Millisecond}, // same second: no move
		{sent: 1070 * time.Millisecond, renewTime: 1070 * time.Millisecond, until: 3070 * time.Millisecond},
		{sent: 2500 * time.Millisecond, renewTime: 2500 * time.Millisecond, until: 4500 * time.Millisecond},
	} {
		now = base.Add(tc.sent)
		f.renewed(base.Add(tc.renewTime), now)
		if _, until := f.lapsed(); !until.Equal(base.Add(tc.until)) {
			t.Errorf("renewal sent at +%s: fence until +%s, want +%s", tc.sent, until.Sub(base), tc.until)
		}
	}
	now = base.Add(4499 * time.Millisecond)
	if lapsed, _ := f.lapsed(); lapsed {
		t.Error("lapsed before its end")
	}
	now = base.Add(4500 * time.Millisecond)
	if lapsed, _ := f.lapsed(); !lapsed {
		t.Error("not lapsed at its end")
	}
}

// fakeLock is a Lease lock whose writes succeed or fail as told.
type fakeLock struct {
	resourcelock.Interface
	err error
}

func (l fakeLock) Create(context.Context, resourcelock.LeaderElectionRecord) error { return l.err }
func (l fakeLock) Update(context.Context, resourcelock.LeaderElectionRecord) error { return l.err }

// TestFencedLock: a successful write naming this replica moves the fence; a failed one
// does not; a release (another holder, or none) closes it before it is sent.
func TestFencedLock(t *testing.T) {
	f := newFence("me", time.Minute)
	rec := func(holder string) resourcelock.LeaderElectionRecord {
		return resourcelock.LeaderElectionRecord{HolderIdentity: holder, RenewTime: metav1.Now()}
	}
	ctx := context.Background()
	if err := (fencedLock{Interface: fakeLock{err: errors.New("conflict")}, f: f}).Update(ctx, rec("me")); err == nil {
		t.Fatal("the failed write's error was lost")
	}
	if lapsed, _ := f.lapsed(); !lapsed {
		t.Fatal("a failed renewal opened the fence")
	}
	if err := (fencedLock{Interface: fakeLock{}, f: f}).Create(ctx, rec("me")); err != nil {
		t.Fatal(err)
	}
	if lapsed, _ := f.lapsed(); lapsed {
		t.Fatal("an acquisition did not open the fence")
	}
	if err := (fencedLock{Interface: fakeLock{}, f: f}).Update(ctx, rec("")); err != nil {
		t.Fatal(err)
	}
	if lapsed, _ := f.lapsed(); !lapsed {
		t.Fatal("a release left the fence open")
	}
}

// TestFenceHold: a write waits while the fence is lapsed and goes on at the next
// renewal, with a context ending when the fence does; it never goes on once the
// leading context ended.
func TestFenceHold(t *testing.T) {
	f := newFence("me", time.Hour)
	got := make(chan error, 1)
	go func() {
		wctx, cancel, err := f.hold(context.Background())
		if err == nil {
			if d, ok := wctx.Deadline(); !ok || time.Until(d) < 59*time.Minute {
				err = errors.New("write context without the fence's deadline")
			}
			cancel()
		}
		got <- err
	}()
	select {
	case err := <-got:
		t.Fatalf("hold returned before any renewal: %v", err)
	case <-time.After(50 * time.Millisecond):
	}
	f.renewed(time.Now(), time.Now())
	if err := <-got; err != nil {
		t.Fatal(err)
	}

	f.revoke()
	ctx, cancel := context.WithCancel(context.Background())
	go func() { _, _, err := f.hold(ctx); got <- err }()
	cancel()
	if err := <-got; !errors.Is(err, context.Canceled) {
		t.Fatalf("hold after the leading context ended: %v, want context.Canceled", err)
	}
}
