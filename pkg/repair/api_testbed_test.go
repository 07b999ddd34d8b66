package repair

// The controller's bookkeeping on a real kube-apiserver (testbed.API: API-only, or
// this test binary's full node when it is up). Pods are created through the API,
// bound to a Node object no kubelet runs, and their validation container's status is
// written through pods/status as a kubelet would. The controller's client (its pod
// cache, its actions and its Events) goes through internal/standin/apiproxy, which logs every
// request and can hold the controller's writes to a pod until the test has changed
// the pod: the action computed from what the controller read reaches the API server
// after the pod moved on, as a write delayed in flight or a stale cache would. Only
// the network namespace look-up and the rules are stand-ins (fakeNetns, applies): the
// real ones are proven by TestRaceRepairInPlace.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"reflect"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/record"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/standin/apiproxy"
	"github.com/meshcni/meshcni/pkg/agent/nodepods"
	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/heal"
)

// apiNode is the node of the pods: a Node object, no kubelet.
const apiNode = "meshcni-repair-api-node"

type apiHarness struct {
	t     *testing.T
	ctx   context.Context
	cs    kubernetes.Interface // the test's own client, straight to the API server
	ns    string
	px    *apiproxy.Proxy
	logs  *logRecords
	apply *applies
	m     *Metrics
}

func startAPI(t *testing.T, ns string, action Action) *apiHarness {
	t.Helper()
	tb := testbed.API(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)
	h := &apiHarness{t: t, ctx: ctx, cs: tb.Client, ns: ns, logs: &logRecords{}, apply: &applies{}}
	if err := tb.CreateNamespace(ctx, ns); err != nil && !apierrors.IsAlreadyExists(errors.Unwrap(err)) {
		t.Fatal(err)
	}
	// Without a controller-manager (API-only) the namespace has no default ServiceAccount.
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default", Namespace: ns}}
	if _, err := h.cs.CoreV1().ServiceAccounts(ns).Create(ctx, sa, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: apiNode}}
	if _, err := h.cs.CoreV1().Nodes().Create(ctx, n, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = h.cs.CoreV1().Namespaces().Delete(context.Background(), ns, metav1.DeleteOptions{})
		_ = h.cs.CoreV1().Nodes().Delete(context.Background(), apiNode, metav1.DeleteOptions{})
	})

	px, err := apiproxy.Start(tb.RESTConfig)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(px.Close)
	h.px = px
	cs, err := kubernetes.NewForConfig(px.Config())
	if err != nil {
		t.Fatal(err)
	}
	pods, err := nodepods.New(cs, apiNode, 0)
	if err != nil {
		t.Fatal(err)
	}
	b := record.NewBroadcaster()
	b.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: cs.CoreV1().Events("")})
	h.m, _ = NewMetrics(nil)
	log := slog.New(recording{out: slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}), recs: h.logs})
	var evictor *heal.Evictor
	if action == ActionEvict {
		hm, err := heal.NewMetrics(nil)
		if err != nil {
			t.Fatal(err)
		}
		// A budget that never binds here: the guards and preconditions are what is proven.
		evictor = &heal.Evictor{Client: cs, Budget: heal.NewBudget(heal.Limits{MaxEvictions: 100, Window: time.Hour, MaxFraction: 1}),
			Meshed: func() int { return 100 }, Metrics: hm, Log: log}
	}
	c, err := New(Options{
		Evictor: evictor,
		Policy:  Policy{Node: apiNode, Action: action, Criteria: criteria(), LabelKey: DefaultLabelKey},
		Backend: backend.Nftables, Client: cs, Pods: pods, Metrics: h.m,
		Events: b.NewRecorder(scheme.Scheme, corev1.EventSource{Component: "meshcni-agent"}),
		Netns:  newFakeNetns(), Apply: h.apply.apply,
		Log: log,
	})
	if err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(ctx)
	done := make(chan struct{}, 2)
	go func() { _ = pods.Run(rctx); done <- struct{}{} }()
	go func() { _ = c.Run(rctx); done <- struct{}{} }()
	t.Cleanup(func() { stop(); <-done; <-done; b.Shutdown() })
	h.eventually("the controller watches", func() bool { return h.logs.has(0, LogWatching, "", nil) })
	return h
}

// eventually polls cond for up to 15 s.
func (h *apiHarness) eventually(what string, cond func() bool) {
	h.t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			h.t.Fatalf("%s: not within 15s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// createPod creates a meshed pod on apiNode and, with st, writes its validation
// container's status through pods/status.
func (h *apiHarness) createPod(name string, st *corev1.ContainerStatus) *corev1.Pod {
	h.t.Helper()
	p := brokenPod()
	p.ObjectMeta = metav1.ObjectMeta{Namespace: h.ns, Name: name, Labels: p.Labels, Annotations: p.Annotations,
		// A controller owner (the API-only test bed runs no controller that would act on it):
		// a pod without one is never evicted.
		OwnerReferences: []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "ReplicaSet", Name: name + "-rs",
			UID: types.UID("00000000-0000-0000-0000-" + fmt.Sprintf("%012x", len(name))), Controller: ptr(true)}}}
	p.Spec.NodeName = apiNode
	p.Status = corev1.PodStatus{}
	created, err := h.cs.CoreV1().Pods(h.ns).Create(h.ctx, p, metav1.CreateOptions{})
	if err != nil {
		h.t.Fatal(err)
	}
	if st == nil {
		return created
	}
	return h.setStatus(created, *st)
}

func (h *apiHarness) setStatus(p *corev1.Pod, st corev1.ContainerStatus) *corev1.Pod {
	h.t.Helper()
	p = p.DeepCopy()
	p.Status.Phase, p.Status.PodIP = corev1.PodPending, "10.0.0.5"
	p.Status.PodIPs = []corev1.PodIP{{IP: "10.0.0.5"}}
	p.Status.InitContainerStatuses = []corev1.ContainerStatus{st}
	out, err := h.cs.CoreV1().Pods(h.ns).UpdateStatus(h.ctx, p, metav1.UpdateOptions{})
	if err != nil {
		h.t.Fatal(err)
	}
	return out
}

// completed is the validation container's status once a run passed after a 126.
func completed() corev1.ContainerStatus {
	st := failedRun("containerd://failed", time.Now().Add(-time.Minute))
	st.LastTerminationState = st.State
	st.State = corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 0, Reason: "Completed", ContainerID: "containerd://passed"}}
	return st
}

func (h *apiHarness) get(name string) (*corev1.Pod, error) {
	return h.cs.CoreV1().Pods(h.ns).Get(h.ctx, name, metav1.GetOptions{})
}

// podWrites are the controller's writes to the pod (any method), as its proxy saw them.
func (h *apiHarness) podWrites(name string) []apiproxy.Request {
	return apiproxy.Writes(h.px.Requests(), "/api/v1/namespaces/"+h.ns+"/pods/"+name)
}

// heldWrite holds the controller's writes to the pod and returns once one is held.
func (h *apiHarness) waitHeld(name, method string) {
	h.t.Helper()
	h.eventually(fmt.Sprintf("a %s of %s held", method, name), func() bool {
		for _, r := range h.podWrites(name) {
			if r.Method == method && r.Forwarded.IsZero() {
				return true
			}
		}
		return false
	})
}

// answered waits until every write to the pod was answered and returns them.
func (h *apiHarness) answered(name string) []apiproxy.Request {
	h.t.Helper()
	var ws []apiproxy.Request
	h.eventually("the writes to "+name+" answered", func() bool {
		ws = h.podWrites(name)
		for _, r := range ws {
			if r.Status == 0 {
				return false
			}
		}
		return len(ws) > 0
	})
	return ws
}

// events sums the counts of the agent's Events with reason on the pod (by UID).
func (h *apiHarness) events(uid types.UID, reason string) int {
	h.t.Helper()
	l, err := h.cs.CoreV1().Events(h.ns).List(h.ctx, metav1.ListOptions{FieldSelector: "involvedObject.uid=" + string(uid) + ",reason=" + reason})
	if err != nil {
		h.t.Fatal(err)
	}
	n := 0
	for _, e := range l.Items {
		if e.Source.Component == "meshcni-agent" {
			n += max(int(e.Count), 1)
		}
	}
	return n
}

func statuses(ws []apiproxy.Request) []string {
	var out []string
	for _, r := range ws {
		out = append(out, fmt.Sprintf("%s %d", r.Method, r.Status))
	}
	return out
}

func (h *apiHarness) replace(name string) *corev1.Pod {
	h.t.Helper()
	zero := int64(0)
	if err := h.cs.CoreV1().Pods(h.ns).Delete(h.ctx, name, metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
		h.t.Fatal(err)
	}
	h.eventually(name+" gone", func() bool { _, err := h.get(name); return apierrors.IsNotFound(err) })
	return h.createPod(name, nil)
}

// TestRealAPIEvict: the evict action on the real API server evicts a broken pod
// through the Eviction API, and never a pod that is not the one it judged: its
// Eviction carries the UID and resourceVersion it read, so a pod whose status moved
// on or a namesake that replaced it meanwhile is refused by the API server (409) and
// stays. A pod without a controller owner is never evicted.
func TestRealAPIEvict(t *testing.T) {
	h := startAPI(t, "meshcni-repair-api-del", ActionEvict)

	t.Run("a broken pod is evicted", func(t *testing.T) {
		h.t = t
		p := h.createPod("del-ok", ptr(failedRun("containerd://run1", time.Now().Add(-10*time.Second))))
		// Without a kubelet the deletion of a bound pod stays graceful: deletionTimestamp set.
		h.eventually("del-ok evicted", func() bool {
			got, err := h.get("del-ok")
			return apierrors.IsNotFound(err) || (err == nil && got.DeletionTimestamp != nil)
		})
		ws := h.answered("del-ok")
		if got := statuses(ws); !reflect.DeepEqual(got, []string{"POST 201"}) || ws[0].Path != "/api/v1/namespaces/"+h.ns+"/pods/del-ok/eviction" {
			t.Errorf("writes to del-ok: %q (%s), want one POST 201 to its eviction subresource", got, ws[0].Path)
		}
		h.eventually("its Event", func() bool { return h.events(p.UID, ReasonDeleted) == 1 })
	})

	t.Run("a bare pod is never evicted", func(t *testing.T) {
		h.t = t
		p := brokenPod()
		p.ObjectMeta = metav1.ObjectMeta{Namespace: h.ns, Name: "del-bare", Labels: p.Labels, Annotations: p.Annotations}
		p.Spec.NodeName = apiNode
		p.Status = corev1.PodStatus{}
		created, err := h.cs.CoreV1().Pods(h.ns).Create(h.ctx, p, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		m := h.logs.mark()
		h.setStatus(created, failedRun("containerd://run1", time.Now().Add(-10*time.Second)))
		h.eventually("the refusal logged", func() bool {
			return h.logs.has(m, heal.LogRefused, "", map[string]string{"pod_name": "del-bare", "reason": heal.RefusedNoController})
		})
		if ws := h.podWrites("del-bare"); len(ws) > 1 { // the status update above is the test's own
			for _, r := range ws {
				if r.Method == "POST" {
					t.Errorf("a bare pod's eviction was sent: %+v", r)
				}
			}
		}
		if got, err := h.get("del-bare"); err != nil || got.DeletionTimestamp != nil {
			t.Errorf("del-bare after the refusal: %v, %v; want it running on", got, err)
		}
	})

	t.Run("a pod whose status moved on while the delete was in flight stays", func(t *testing.T) {
		h.t = t
		h.px.HoldWrites("/api/v1/namespaces/" + h.ns + "/pods/del-rv")
		p := h.createPod("del-rv", ptr(failedRun("containerd://run1", time.Now().Add(-10*time.Second))))
		h.waitHeld("del-rv", "POST")
		m := h.logs.mark()
		healthy := h.setStatus(p, completed())
		h.px.Heal()
		ws := h.answered("del-rv")
		h.eventually("the controller judges the healthy pod", func() bool { return h.logs.has(m, LogNotBroken, string(p.UID), nil) })
		if got, err := h.get("del-rv"); err != nil || got.UID != p.UID || got.ResourceVersion != healthy.ResourceVersion {
			t.Fatalf("del-rv after the held delete: %v, %v; want it unchanged", got, err)
		}
		for _, r := range h.podWrites("del-rv") {
			if r.Status/100 == 2 {
				t.Errorf("a write to del-rv succeeded: %+v", r)
			}
		}
		t.Logf("writes to del-rv: %q", statuses(ws))
		if ws[0].Status != 409 {
			t.Errorf("the held eviction answered %d, want 409 (resourceVersion precondition)", ws[0].Status)
		}
	})

	t.Run("a namesake that replaced the pod while the delete was in flight stays", func(t *testing.T) {
		h.t = t
		h.px.HoldWrites("/api/v1/namespaces/" + h.ns + "/pods/del-uid")
		old := h.createPod("del-uid", ptr(failedRun("containerd://run1", time.Now().Add(-10*time.Second))))
		h.waitHeld("del-uid", "POST")
		m := h.logs.mark()
		namesake := h.replace("del-uid")
		h.px.Heal()
		ws := h.answered("del-uid")
		h.eventually("the controller judges the namesake", func() bool { return h.logs.has(m, LogNotBroken, string(namesake.UID), nil) })
		if got, err := h.get("del-uid"); err != nil || got.UID != namesake.UID {
			t.Fatalf("del-uid after the held delete: %v, %v; want the namesake %s", got, err, namesake.UID)
		}
		t.Logf("writes to del-uid (old UID %s): %q", old.UID, statuses(ws))
		if ws[0].Status != 409 {
			t.Errorf("the held eviction answered %d, want 409 (UID precondition)", ws[0].Status)
		}
		for _, r := range ws {
			if r.Status/100 == 2 {
				t.Errorf("a write to del-uid succeeded: %+v", r)
			}
		}
	})
	if n := testutilCount(h.m, ActionEvict, resultSuccess); n != 1 {
		t.Errorf("evict successes %v, want 1", n)
	}
}

// TestRealAPILabel: the label action writes the label and nothing else, once; and not
// on a pod whose status moved on, nor on a namesake, while its write was in flight.
func TestRealAPILabel(t *testing.T) {
	h := startAPI(t, "meshcni-repair-api-label", ActionLabel)

	t.Run("the label and nothing else", func(t *testing.T) {
		h.t = t
		before := h.createPod("lab-ok", ptr(failedRun("containerd://run1", time.Now().Add(-10*time.Second))))
		var after *corev1.Pod
		h.eventually("lab-ok labelled", func() bool {
			p, err := h.get("lab-ok")
			after = p
			return err == nil && p.Labels[DefaultLabelKey] != ""
		})
		want := before.DeepCopy()
		want.Labels[DefaultLabelKey] = LabelValue
		for what, pair := range map[string][2]any{
			"labels": {after.Labels, want.Labels}, "annotations": {after.Annotations, want.Annotations},
			"uid": {after.UID, want.UID}, "spec": {after.Spec, want.Spec}, "status": {after.Status, want.Status},
		} {
			if !reflect.DeepEqual(pair[0], pair[1]) {
				t.Errorf("%s after the label: %+v, want %+v", what, pair[0], pair[1])
			}
		}
		if ws := statuses(h.answered("lab-ok")); !reflect.DeepEqual(ws, []string{"PATCH 200"}) {
			t.Errorf("writes to lab-ok: %q, want one PATCH 200", ws)
		}
		h.eventually("its Event", func() bool { return h.events(before.UID, ReasonLabeled) == 1 })
	})

	t.Run("a pod whose status moved on while the label was in flight is not labelled", func(t *testing.T) {
		h.t = t
		h.px.HoldWrites("/api/v1/namespaces/" + h.ns + "/pods/lab-rv")
		p := h.createPod("lab-rv", ptr(failedRun("containerd://run1", time.Now().Add(-10*time.Second))))
		h.waitHeld("lab-rv", "PATCH")
		m := h.logs.mark()
		h.setStatus(p, completed())
		h.px.Heal()
		ws := h.answered("lab-rv")
		h.eventually("the controller judges the healthy pod", func() bool { return h.logs.has(m, LogNotBroken, string(p.UID), nil) })
		t.Logf("writes to lab-rv: %q", statuses(ws))
		if ws[0].Status != 409 {
			t.Errorf("the held PATCH answered %d, want 409 (resourceVersion in the patch)", ws[0].Status)
		}
		if got, err := h.get("lab-rv"); err != nil || got.Labels[DefaultLabelKey] != "" {
			t.Fatalf("lab-rv after the held label: labels %v, %v; want no %s", got.Labels, err, DefaultLabelKey)
		}
	})

	t.Run("a namesake that replaced the pod while the label was in flight is not labelled", func(t *testing.T) {
		h.t = t
		h.px.HoldWrites("/api/v1/namespaces/" + h.ns + "/pods/lab-uid")
		h.createPod("lab-uid", ptr(failedRun("containerd://run1", time.Now().Add(-10*time.Second))))
		h.waitHeld("lab-uid", "PATCH")
		m := h.logs.mark()
		namesake := h.replace("lab-uid")
		h.px.Heal()
		ws := h.answered("lab-uid")
		h.eventually("the controller judges the namesake", func() bool { return h.logs.has(m, LogNotBroken, string(namesake.UID), nil) })
		t.Logf("writes to lab-uid: %q", statuses(ws))
		if ws[0].Status != 409 {
			t.Errorf("the held PATCH answered %d, want 409 (resourceVersion in the patch)", ws[0].Status)
		}
		if got, err := h.get("lab-uid"); err != nil || got.UID != namesake.UID || got.Labels[DefaultLabelKey] != "" {
			t.Fatalf("lab-uid after the held label: %v, %v; want the namesake %s unlabelled", got, err, namesake.UID)
		}
	})
}

// TestRealAPIRepairBookkeeping: the in-place repair once per failed run, runs started
// before the last repair ignored, at most MaxRepairsPerPod repairs, then one
// MeshcniRepairGaveUp Warning per failed run past the limit — judged from statuses
// and times as the real API server stores them (whole seconds), Events read back from
// it.
func TestRealAPIRepairBookkeeping(t *testing.T) {
	h := startAPI(t, "meshcni-repair-api-rep", ActionRepair)
	p := h.createPod("rep", ptr(failedRun("containerd://run1", time.Now().Add(-10*time.Second))))
	h.eventually("repaired once", func() bool { return h.apply.count() == 1 })
	repairedAt := time.Now()
	h.eventually("its Event", func() bool { return h.events(p.UID, ReasonRepaired) == 1 })

	// The same failed run again (the kubelet reruns the container): nothing.
	st := p.Status.InitContainerStatuses[0]
	st.LastTerminationState, st.State = st.State, corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}
	m := h.logs.mark()
	p = h.setStatus(p, st)
	h.eventually("judged", func() bool {
		return h.logs.has(m, LogNothingToDo, string(p.UID), map[string]string{"container_id": "containerd://run1"})
	})
	// A run that started before the repair (the same second or earlier): nothing.
	m = h.logs.mark()
	p = h.setStatus(p, failedRun("containerd://early", repairedAt.Add(-2*time.Second)))
	h.eventually("judged", func() bool {
		return h.logs.has(m, LogNothingToDo, string(p.UID), map[string]string{"container_id": "containerd://early"})
	})
	if n := h.apply.count(); n != 1 {
		t.Fatalf("%d repairs after runs that need none, want 1", n)
	}
	// Runs that started after the last repair: repaired, up to MaxRepairsPerPod.
	for i := 2; i <= MaxRepairsPerPod; i++ {
		p = h.setStatus(p, failedRun(fmt.Sprintf("containerd://late%d", i), time.Now().Add(time.Duration(2*i)*time.Second)))
		h.eventually(fmt.Sprintf("repair %d", i), func() bool { return h.apply.count() == i })
	}
	h.eventually("one Event per repair", func() bool { return h.events(p.UID, ReasonRepaired) == MaxRepairsPerPod })
	// One more: given up, with a Warning, no repair.
	p = h.setStatus(p, failedRun("containerd://late-last", time.Now().Add(time.Minute)))
	h.eventually("the give-up Event", func() bool { return h.events(p.UID, ReasonGaveUp) == 1 })
	// The same run seen again: handled, no second Warning.
	st = p.Status.InitContainerStatuses[0]
	st.RestartCount++
	m = h.logs.mark()
	p = h.setStatus(p, st)
	h.eventually("judged", func() bool {
		return h.logs.has(m, LogNothingToDo, string(p.UID), map[string]string{"container_id": "containerd://late-last"})
	})
	if n := h.apply.count(); n != MaxRepairsPerPod {
		t.Errorf("%d repairs, want %d", n, MaxRepairsPerPod)
	}
	if n := h.events(p.UID, ReasonGaveUp); n != 1 {
		t.Errorf("%d give-up Events, want 1", n)
	}
	if got := h.podWrites("rep"); len(got) != 0 {
		t.Errorf("the in-place repair wrote the pod: %q", statuses(got))
	}
}

func ptr[T any](v T) *T { return &v }

func testutilCount(m *Metrics, a Action, result string) float64 {
	return testutil.ToFloat64(m.Repairs.WithLabelValues(string(a), result))
}
