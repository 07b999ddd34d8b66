package heal

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

type warnings []string

func (w *warnings) Warning(reason, msg string) { *w = append(*w, reason+": "+msg) }

func ownedPod(name string) *corev1.Pod {
	yes := true
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "app", Name: name, UID: "uid-" + "x",
		OwnerReferences: []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "ReplicaSet", Name: "rs-" + name, Controller: &yes}}}}
}

// TestEvictorGuards (pure logic over the fake clientset; the real API server's
// answers are the test bed's): each guard leaves the pod alone with its log line
// and metric, and only an allowed pod reaches the Eviction API.
func TestEvictorGuards(t *testing.T) {
	bare := ownedPod("bare")
	bare.OwnerReferences = nil
	mirror := ownedPod("mirror")
	mirror.Annotations = map[string]string{MirrorAnnotation: "x"}
	gr := schema.GroupResource{Resource: "pods"}
	for _, tt := range []struct {
		name   string
		pod    *corev1.Pod
		answer error // of the Eviction API
		reason string
	}{
		{"evicted", ownedPod("web"), nil, ""},
		{"bare pod", bare, nil, RefusedNoController},
		{"mirror pod", mirror, nil, RefusedMirror},
		{"429", ownedPod("web"), apierrors.NewTooManyRequests("Cannot evict pod as it would violate the pod's disruption budget.", 0), RefusedDisruption},
		{"403", ownedPod("web"), apierrors.NewForbidden(gr, "web", nil), RefusedForbidden},
	} {
		t.Run(tt.name, func(t *testing.T) {
			cs := fake.NewClientset(tt.pod)
			evictions := 0
			cs.PrependReactor("create", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
				if a.GetSubresource() != "eviction" {
					return false, nil, nil
				}
				evictions++
				return true, nil, tt.answer
			})
			m, _ := NewMetrics(nil)
			var logs bytes.Buffer
			e := &Evictor{Client: cs, Budget: NewBudget(Limits{}), Meshed: func() int { return 100 }, Metrics: m, Log: slog.New(slog.NewTextHandler(&logs, nil))}
			err := e.Evict(context.Background(), tt.pod)
			if tt.reason == "" {
				if err != nil || evictions != 1 || testutil.ToFloat64(m.Evictions) != 1 {
					t.Fatalf("err %v, evictions %d", err, evictions)
				}
				return
			}
			r, ok := IsRefused(err)
			if !ok || r.Reason != tt.reason {
				t.Fatalf("err %v, want refused %s", err, tt.reason)
			}
			if n := testutil.ToFloat64(m.Refusals.WithLabelValues(tt.reason)); n != 1 || testutil.ToFloat64(m.Evictions) != 0 {
				t.Errorf("refusals{%s} %v, evictions %v", tt.reason, n, testutil.ToFloat64(m.Evictions))
			}
			if !strings.Contains(logs.String(), LogRefused) || !strings.Contains(logs.String(), "reason="+tt.reason) {
				t.Errorf("log %q", logs.String())
			}
			if (tt.answer == nil) != (evictions == 0) {
				t.Errorf("%d calls of the Eviction API", evictions)
			}
		})
	}
}

// TestEvictorBreakerWarnsOnce: the eviction past the budget opens the breaker:
// one Warning on the agent's Pod, the gauge at 1, nothing more evicted.
func TestEvictorBreakerWarnsOnce(t *testing.T) {
	cs := fake.NewClientset()
	m, _ := NewMetrics(nil)
	var w warnings
	e := &Evictor{Client: cs, Budget: NewBudget(Limits{MaxEvictions: 2}), Meshed: func() int { return 100 }, Agent: &w, Metrics: m, Log: slog.New(slog.DiscardHandler)}
	for i, name := range []string{"a", "b", "c", "d", "e"} {
		err := e.Evict(context.Background(), ownedPod(name))
		if (i < 2) != (err == nil) {
			t.Fatalf("pod %s: %v", name, err)
		}
	}
	if len(w) != 1 || !strings.HasPrefix(w[0], EventBreakerOpen) || testutil.ToFloat64(m.Breaker) != 1 ||
		testutil.ToFloat64(m.Evictions) != 2 || testutil.ToFloat64(m.Refusals.WithLabelValues(RefusedBreaker)) != 3 {
		t.Errorf("warnings %q, breaker %v, evictions %v", w, testutil.ToFloat64(m.Breaker), testutil.ToFloat64(m.Evictions))
	}
}
