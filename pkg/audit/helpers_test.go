package audit_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/record"

	"github.com/meshcni/meshcni/pkg/audit"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/engine"
	"github.com/meshcni/meshcni/pkg/heal"
	"github.com/meshcni/meshcni/pkg/podnetns"
)

// pods is a pod source for the auditor (the agent's is the node's informer cache).
type pods struct {
	mu   sync.Mutex
	list []*corev1.Pod
}

func (p *pods) List() []*corev1.Pod {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]*corev1.Pod(nil), p.list...)
}

func (p *pods) Get(ns, name string) (*corev1.Pod, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, x := range p.list {
		if x.Namespace == ns && x.Name == name {
			return x, true
		}
	}
	return nil, false
}

func (p *pods) set(list ...*corev1.Pod) {
	p.mu.Lock()
	p.list = list
	p.mu.Unlock()
}

// netnsByName finds a pod's namespace by the pod's name: the scratch namespaces all
// hold the same addresses, so podnetns.Finder (proven in pkg/podnetns) would
// refuse to choose. The handle is podnetns's own (the namespace held open).
type netnsByName struct {
	mu    sync.Mutex
	paths map[string]string
	finds int
}

func (n *netnsByName) Locate(_ context.Context, pod *corev1.Pod) (*podnetns.Handle, error) {
	n.mu.Lock()
	path, ok := n.paths[pod.Name]
	n.finds++
	n.mu.Unlock()
	if !ok {
		return nil, fmt.Errorf("pod %s: %w", pod.Name, podnetns.ErrNotFound)
	}
	h, err := podnetns.Open(path)
	if errors.Is(err, os.ErrNotExist) || (err != nil && !isNetnsMount(path)) {
		// Gone, or half gone: testutil.DeleteNetns unmounts before it removes the
		// file, and a round may open the path in between. The real Finder scans
		// mounted namespaces only, so it never sees that state.
		return nil, fmt.Errorf("pod %s: %w", pod.Name, podnetns.ErrNotFound)
	}
	return h, err
}

// isNetnsMount says whether path still has a network namespace mounted on it.
func isNetnsMount(path string) bool {
	var st unix.Statfs_t
	return unix.Statfs(path, &st) == nil && st.Type == unix.NSFS_MAGIC
}

func (n *netnsByName) found() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.finds
}

const node = "node-a"

// meshedPod is an injected pod as Istio writes it, running on node, with ip.
func meshedPod(name, ip string, annotations map[string]string) *corev1.Pod {
	ann := map[string]string{capture.AnnotationStatus: `{"containers":["istio-proxy"]}`}
	for k, v := range annotations {
		ann[k] = v
	}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "app", Name: name, UID: types.UID("uid-" + name), Annotations: ann, ResourceVersion: "7"},
		Spec: corev1.PodSpec{
			NodeName:       node,
			InitContainers: []corev1.Container{{Name: "istio-validation", Image: "proxyv2"}},
			Containers:     []corev1.Container{{Name: "app", Image: "app"}, {Name: capture.ProxyContainer, Image: "proxyv2", Args: []string{"proxy", "sidecar"}}},
		},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ip, PodIPs: []corev1.PodIP{{IP: ip}}},
	}
}

// events drains the fake recorder.
func events(r *record.FakeRecorder) []string {
	var out []string
	for {
		select {
		case e := <-r.Events:
			out = append(out, e)
		default:
			return out
		}
	}
}

func count(m *audit.Metrics, detected bool, r engine.Reason) int {
	v := m.Repaired
	if detected {
		v = m.Detected
	}
	return int(testutil.ToFloat64(v.WithLabelValues(string(r))))
}

func hasEvent(evs []string, reason string, parts ...string) bool {
	for _, e := range evs {
		if !strings.HasPrefix(e, "Warning "+reason+" ") {
			continue
		}
		ok := true
		for _, p := range parts {
			ok = ok && strings.Contains(e, p)
		}
		if ok {
			return true
		}
	}
	return false
}

func testutilToFloat(m *audit.Metrics, stage string) float64 {
	return testutil.ToFloat64(m.Errors.WithLabelValues(stage))
}

// evictor is the eviction path over the fake clientset, whose Eviction API
// deletes the pod (the real API server's answers are the test bed's).
func evictor(cs *fake.Clientset) *heal.Evictor {
	cs.PrependReactor("create", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.GetSubresource() != "eviction" {
			return false, nil, nil
		}
		ev := a.(k8stesting.CreateAction).GetObject().(*policyv1.Eviction)
		return true, nil, cs.Tracker().Delete(corev1.SchemeGroupVersion.WithResource("pods"), ev.Namespace, ev.Name)
	})
	m, _ := heal.NewMetrics(nil)
	return &heal.Evictor{Client: cs, Budget: heal.NewBudget(heal.Limits{}), Meshed: func() int { return 100 }, Metrics: m, Log: slog.New(slog.DiscardHandler)}
}

// owned gives the pod a controller owner (an evictable pod).
func owned(pod *corev1.Pod) *corev1.Pod {
	yes := true
	pod.OwnerReferences = []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "ReplicaSet", Name: pod.Name + "-rs", Controller: &yes}}
	return pod
}
