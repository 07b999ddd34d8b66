package nodepods_test

import (
	"context"
	"fmt"
	"sort"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/pkg/agent/nodepods"
)

func pod(ns, name, node string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec:       corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "c", Image: "example.invalid/c:1"}}},
	}
}

// TestNodeScoped proves against a real API server that the cache holds exactly its
// node's pods (the field selector reaches the server), follows creations and
// deletions, and drops managed fields.
func TestNodeScoped(t *testing.T) {
	tb := testbed.API(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ns := fmt.Sprintf("nodepods-%d", time.Now().UnixNano()%1e6)
	if err := tb.CreateNamespace(ctx, ns); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = tb.Client.CoreV1().Namespaces().Delete(context.Background(), ns, metav1.DeleteOptions{})
	})
	for i, node := range []string{"node-a", "node-b", "node-a", "", "node-a"} {
		if _, err := tb.Client.CoreV1().Pods(ns).Create(ctx, pod(ns, fmt.Sprintf("p%d", i), node), metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := nodepods.New(tb.Client, "", 0); err == nil {
		t.Fatal("New with no node name: want an error")
	}
	c, err := nodepods.New(tb.Client, "node-a", 0)
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	defer func() { stop(); <-done }()
	if !c.WaitForSync(ctx) {
		t.Fatal("cache never synced")
	}
	names := func() []string {
		var out []string
		for _, p := range c.List() {
			if p.Namespace == ns {
				out = append(out, p.Name)
			}
		}
		sort.Strings(out)
		return out
	}
	if got := fmt.Sprint(names()); got != "[p0 p2 p4]" {
		t.Fatalf("cached pods = %s, want node-a's [p0 p2 p4]", got)
	}
	p, ok := c.Get(ns, "p0")
	if !ok {
		t.Fatal("Get p0: not cached")
	}
	if len(p.ManagedFields) != 0 {
		t.Fatalf("managed fields kept: %d entries", len(p.ManagedFields))
	}
	if _, ok := c.Get(ns, "p1"); ok {
		t.Fatal("Get p1 (node-b): cached, want absent")
	}
	if err := tb.Client.CoreV1().Pods(ns).Delete(ctx, "p2", metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
		t.Fatal(err)
	}
	if _, err := tb.Client.CoreV1().Pods(ns).Create(ctx, pod(ns, "p5", "node-a"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	err = wait.PollUntilContextTimeout(ctx, 20*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		return fmt.Sprint(names()) == "[p0 p4 p5]", nil
	})
	if err != nil {
		t.Fatalf("after delete p2 + create p5: cached %v, want [p0 p4 p5]", names())
	}
}
