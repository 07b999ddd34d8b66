package audit_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/meshcni/meshcni/pkg/audit"
	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/engine"
	"github.com/meshcni/meshcni/pkg/podnetns"
	"github.com/meshcni/meshcni/pkg/spec"
)

// ownNetns hands out the test process's own namespace (a real namespace file any
// process may open): the check is faked, so nothing is read there.
type ownNetns struct{}

func (ownNetns) Locate(context.Context, *corev1.Pod) (*podnetns.Handle, error) {
	return podnetns.Open("/proc/self/ns/net")
}

// checks counts fake checks and the most in flight at once.
type checks struct {
	n, inFlight, max atomic.Int32
	hold             time.Duration
}

func (c *checks) check(context.Context, engine.Options, *spec.Spec) (engine.Report, error) {
	c.n.Add(1)
	cur := c.inFlight.Add(1)
	defer c.inFlight.Add(-1)
	for {
		m := c.max.Load()
		if cur <= m || c.max.CompareAndSwap(m, cur) {
			break
		}
	}
	time.Sleep(c.hold)
	return engine.Report{Backend: backend.Nftables}, nil
}

func fakeAuditor(t *testing.T, p *pods, c *checks, mut func(*audit.Options)) *audit.Auditor {
	t.Helper()
	a, _, _ := newAuditor(t, p, nil, func(o *audit.Options) {
		o.Netns = ownNetns{}
		o.Check = c.check
		o.Apply = func(context.Context, engine.Options, *spec.Spec) (backend.Kind, error) {
			t.Error("apply without drift")
			return "", nil
		}
		if mut != nil {
			mut(o)
		}
	})
	return a
}

func TestConcurrencyBound(t *testing.T) {
	var list []*corev1.Pod
	for i := range 20 {
		list = append(list, meshedPod(fmt.Sprintf("p%d", i), fmt.Sprintf("10.1.0.%d", i+2), nil))
	}
	c := &checks{hold: 5 * time.Millisecond}
	a := fakeAuditor(t, &pods{list: list}, c, func(o *audit.Options) { o.Concurrency = 3 })
	if st := a.Round(context.Background()); st[audit.Clean] != 20 {
		t.Fatalf("round %v", st)
	}
	if m := c.max.Load(); m > 3 || m < 2 {
		t.Fatalf("%d checks in flight at most, want 3 (the bound)", m)
	}
}

// TestRunStartAndTrigger: Run audits every pod at start, then a pod whose
// containers start, at once (the period is long).
func TestRunStartAndTrigger(t *testing.T) {
	pod := meshedPod("web", "10.1.0.2", nil)
	other := meshedPod("other", "10.1.0.3", nil)
	skipped := meshedPod("plain", "10.1.0.4", nil)
	skipped.Annotations = nil // not injected: the plugin skips it, so does the audit
	c := &checks{}
	a := fakeAuditor(t, &pods{list: []*corev1.Pod{pod, other, skipped}}, c, func(o *audit.Options) { o.Period = time.Hour })
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		if err := a.Run(ctx); err != nil {
			t.Error(err)
		}
	}()
	waitN := func(want int32) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for c.n.Load() < want {
			if time.Now().After(deadline) {
				t.Fatalf("%d checks, want %d", c.n.Load(), want)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	waitN(2)
	a.ContainersStarted(pod)
	waitN(3)
	cancel()
	wg.Wait()
	if n := c.n.Load(); n != 3 {
		t.Fatalf("%d checks, want 3: two at start (the skipped pod not checked), one triggered", n)
	}
}
