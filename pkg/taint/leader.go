package taint

import (
	"context"
	"errors"
	"sync"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
)

// ErrLostLease is returned by Run when this replica stopped leading before its context
// ended (it could not renew the Lease in time).
var ErrLostLease = errors.New("lost the leader Lease")

// runElected campaigns for the Lease and leads while it holds it. When ctx ends, the
// workers stop first and only then is the Lease released (unless KeepLeaseOnExit), so
// the next leader never overlaps a write of this one.
func (c *Controller) runElected(ctx context.Context) error {
	// Every renewal also moves the fence that each node write waits for (fence.go).
	lock := fencedLock{f: c.fence, Interface: &resourcelock.LeaseLock{
		LeaseMeta:  metav1.ObjectMeta{Namespace: c.cfg.LeaseNamespace, Name: c.cfg.LeaseName},
		Client:     c.cs.CoordinationV1(),
		LockConfig: resourcelock.ResourceLockConfig{Identity: c.cfg.Identity},
	}}
	// The elector's context outlives ctx until the workers are done.
	leCtx, stopLE := context.WithCancel(context.WithoutCancel(ctx))
	defer stopLE()
	var mu sync.Mutex
	var working chan struct{} // closed when the workers of the leading term stopped
	workersDone := func() {
		mu.Lock()
		w := working
		mu.Unlock()
		if w != nil {
			<-w
		}
	}
	log := c.log.With("lease", c.cfg.LeaseNamespace+"/"+c.cfg.LeaseName, "identity", c.cfg.Identity)
	le, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
		Lock:            lock,
		Name:            c.cfg.LeaseName,
		LeaseDuration:   c.cfg.LeaseDuration,
		RenewDeadline:   c.cfg.RenewDeadline,
		RetryPeriod:     c.cfg.RetryPeriod,
		ReleaseOnCancel: !c.cfg.KeepLeaseOnExit,
		WatchDog:        c.watchdog,
		Callbacks: leaderelection.LeaderCallbacks{
			OnStartedLeading: func(lctx context.Context) {
				mu.Lock()
				if ctx.Err() != nil || lctx.Err() != nil {
					mu.Unlock()
					return
				}
				done := make(chan struct{})
				working = done
				mu.Unlock()
				defer close(done)
				wctx, cancel := context.WithCancel(lctx)
				defer cancel()
				defer context.AfterFunc(ctx, cancel)()
				c.lead(wctx)
			},
			OnStoppedLeading: func() {},
			OnNewLeader: func(id string) {
				log.Info("leader observed", "leader", id)
			},
		},
	})
	if err != nil {
		return err
	}
	c.watchdog.SetLeaderElection(le)
	go func() {
		select {
		case <-ctx.Done():
		case <-leCtx.Done():
			return
		}
		workersDone()
		stopLE()
	}()
	log.Info("campaigning for the Lease")
	le.Run(leCtx)
	workersDone()
	if ctx.Err() != nil {
		return nil
	}
	return ErrLostLease
}
