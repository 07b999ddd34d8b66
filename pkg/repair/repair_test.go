package repair

import (
	"regexp"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/pkg/capture"
)

const node = "node-a"

// brokenPod is a meshed pod on node whose istio-validation init container last
// exited 126 (current state), as the race leaves it.
func brokenPod() *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: "app", Name: "web", UID: "uid-1", Labels: map[string]string{"app": "web"},
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "ReplicaSet", Name: "web-1", UID: "rs-1", Controller: ptr(true)}},
			Annotations:     map[string]string{capture.AnnotationStatus: `{"containers":["istio-proxy"]}`},
		},
		Spec: corev1.PodSpec{
			NodeName:       node,
			InitContainers: []corev1.Container{{Name: DefaultInitContainer, Image: "proxyv2"}},
			Containers:     []corev1.Container{{Name: "app", Image: "app"}, {Name: capture.ProxyContainer, Image: "proxyv2", Args: []string{"proxy", "sidecar"}}},
		},
		Status: corev1.PodStatus{
			Phase: corev1.PodPending, PodIP: "10.0.0.5",
			InitContainerStatuses: []corev1.ContainerStatus{{
				Name: DefaultInitContainer, RestartCount: 1,
				State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{
					ExitCode: 126, ContainerID: "containerd://run2", Message: "validation failed: no redirect",
					FinishedAt: metav1.NewTime(time.Unix(100, 0)),
				}},
			}},
		},
	}
}

func criteria() Criteria {
	return Criteria{InitContainer: DefaultInitContainer, ExitCode: DefaultExitCode}
}

func TestBroken(t *testing.T) {
	for _, tc := range []struct {
		name   string
		mut    func(*corev1.Pod)
		crit   func(*Criteria)
		broken bool
		why    string // substring of the reason when not broken
		id     string // failed run's container ID when broken
	}{
		{name: "terminated 126", broken: true, id: "containerd://run2"},
		{name: "running again, last termination 126", broken: true, id: "containerd://run1", mut: func(p *corev1.Pod) {
			s := &p.Status.InitContainerStatuses[0]
			s.State = corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}
			s.LastTerminationState = corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 126, ContainerID: "containerd://run1"}}
		}},
		{name: "waiting (back-off), last termination 126", broken: true, id: "containerd://run1", mut: func(p *corev1.Pod) {
			s := &p.Status.InitContainerStatuses[0]
			s.State = corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "CrashLoopBackOff"}}
			s.LastTerminationState = corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 126, ContainerID: "containerd://run1"}}
		}},
		{name: "completed after a 126", why: "completed", mut: func(p *corev1.Pod) {
			s := &p.Status.InitContainerStatuses[0]
			s.LastTerminationState = s.State
			s.State = corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 0}}
		}},
		{name: "no status annotation", why: capture.AnnotationStatus, mut: func(p *corev1.Pod) { p.Annotations = nil }},
		{name: "being deleted", why: "deleted", mut: func(p *corev1.Pod) { now := metav1.Now(); p.DeletionTimestamp = &now }},
		{name: "other exit code", why: "last exited 1, not 126", mut: func(p *corev1.Pod) {
			p.Status.InitContainerStatuses[0].State.Terminated.ExitCode = 1
		}},
		{name: "running the first time", why: "has not failed", mut: func(p *corev1.Pod) {
			p.Status.InitContainerStatuses[0].State = corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}
		}},
		{name: "no validation container status", why: "no status", mut: func(p *corev1.Pod) {
			p.Status.InitContainerStatuses[0].Name = "istio-init"
		}},
		{name: "other container name configured", why: "no status", crit: func(c *Criteria) { c.InitContainer = "check" }},
		{name: "configured exit code", broken: true, id: "containerd://run2", crit: func(c *Criteria) { c.ExitCode = 3 }, mut: func(p *corev1.Pod) {
			p.Status.InitContainerStatuses[0].State.Terminated.ExitCode = 3
		}},
		{name: "message matches", broken: true, id: "containerd://run2", crit: func(c *Criteria) { c.Message = regexp.MustCompile(`no redirect$`) }},
		{name: "message does not match", why: "does not match", crit: func(c *Criteria) { c.Message = regexp.MustCompile(`^iptables`) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := brokenPod()
			if tc.mut != nil {
				tc.mut(p)
			}
			c := criteria()
			if tc.crit != nil {
				tc.crit(&c)
			}
			f, why := c.Broken(p)
			if (f != nil) != tc.broken {
				t.Fatalf("broken = %v (%q), want %v", f != nil, why, tc.broken)
			}
			if tc.broken && f.ContainerID != tc.id {
				t.Fatalf("failed run %q, want %q", f.ContainerID, tc.id)
			}
			if !tc.broken && !strings.Contains(why, tc.why) {
				t.Fatalf("reason %q, want it to mention %q", why, tc.why)
			}
		})
	}
	if f, why := criteria().Broken(nil); f != nil || why == "" {
		t.Fatalf("nil pod: %v %q", f, why)
	}
}

func TestDecide(t *testing.T) {
	mustLabels, _ := ParseLabelSelector("app=web")
	otherLabels, _ := ParseLabelSelector("app in (db)")
	mustFields, _ := ParseFieldSelector("metadata.namespace=app")
	otherFields, _ := ParseFieldSelector("metadata.namespace!=app")
	for _, tc := range []struct {
		name   string
		action Action
		mut    func(*corev1.Pod)
		pol    func(*Policy)
		act    bool
		key    string
		why    string
	}{
		{name: "repair", action: ActionRepair, act: true, key: "uid-1/containerd://run2"},
		{name: "repair keys by failed run", action: ActionRepair, act: true, key: "uid-1/containerd://run1", mut: func(p *corev1.Pod) {
			s := &p.Status.InitContainerStatuses[0]
			s.State = corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}
			s.LastTerminationState = corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 126, ContainerID: "containerd://run1"}}
		}},
		{name: "repair without container ID keys by finish time", action: ActionRepair, act: true, key: "uid-1/100000000000", mut: func(p *corev1.Pod) {
			p.Status.InitContainerStatuses[0].State.Terminated.ContainerID = ""
		}},
		{name: "delete", action: ActionEvict, act: true, key: "uid-1"},
		{name: "label", action: ActionLabel, act: true, key: "uid-1"},
		{name: "label: already labelled", action: ActionLabel, why: "already labelled", mut: func(p *corev1.Pod) { p.Labels[DefaultLabelKey] = "true" }},
		{name: "label: other value is relabelled", action: ActionLabel, act: true, key: "uid-1", mut: func(p *corev1.Pod) { p.Labels[DefaultLabelKey] = "false" }},
		{name: "repair: failed pod", action: ActionRepair, why: "will not run again", mut: func(p *corev1.Pod) { p.Status.Phase = corev1.PodFailed }},
		{name: "delete: failed pod", action: ActionEvict, act: true, key: "uid-1", mut: func(p *corev1.Pod) { p.Status.Phase = corev1.PodFailed }},
		{name: "other node", action: ActionEvict, why: "node", mut: func(p *corev1.Pod) { p.Spec.NodeName = "node-b" }},
		{name: "excluded namespace", action: ActionEvict, why: "namespace app is excluded", pol: func(p *Policy) { p.Mesh.ExcludeNamespaces = []string{"kube-system", "app"} }},
		{name: "inject=false", action: ActionRepair, why: "not meshed", mut: func(p *corev1.Pod) { p.Labels[capture.AnnotationInject] = "false" }},
		{name: "no istio-proxy", action: ActionRepair, why: "not meshed", mut: func(p *corev1.Pod) { p.Spec.Containers = p.Spec.Containers[:1] }},
		{name: "has istio-init", action: ActionEvict, why: "not meshed", mut: func(p *corev1.Pod) {
			p.Spec.InitContainers = append(p.Spec.InitContainers, corev1.Container{Name: capture.InitContainer})
		}},
		{name: "host network", action: ActionEvict, why: "host network", mut: func(p *corev1.Pod) { p.Spec.HostNetwork = true }},
		{name: "healthy", action: ActionEvict, why: "completed", mut: func(p *corev1.Pod) {
			p.Status.InitContainerStatuses[0].State.Terminated.ExitCode = 0
		}},
		{name: "label selector matches", action: ActionEvict, act: true, key: "uid-1", pol: func(p *Policy) { p.LabelSelector = mustLabels }},
		{name: "label selector leaves out", action: ActionEvict, why: "labels not selected", pol: func(p *Policy) { p.LabelSelector = otherLabels }},
		{name: "field selector matches", action: ActionEvict, act: true, key: "uid-1", pol: func(p *Policy) { p.FieldSelector = mustFields }},
		{name: "field selector leaves out", action: ActionEvict, why: "fields not selected", pol: func(p *Policy) { p.FieldSelector = otherFields }},
		{name: "unknown action", action: "reboot", why: "unknown action"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := brokenPod()
			if tc.mut != nil {
				tc.mut(p)
			}
			pol := Policy{Node: node, Action: tc.action, Criteria: criteria(), LabelKey: DefaultLabelKey,
				Mesh: capture.Config{ExcludeNamespaces: []string{"kube-system"}}}
			if tc.pol != nil {
				tc.pol(&pol)
			}
			d := Decide(p, pol)
			if d.Act != tc.act {
				t.Fatalf("act = %v (%q), want %v", d.Act, d.Reason, tc.act)
			}
			if tc.act {
				if d.Key != tc.key || d.Action != tc.action || d.Failure == nil {
					t.Fatalf("decision %+v, want key %q action %s", d, tc.key, tc.action)
				}
			} else if !strings.Contains(d.Reason, tc.why) {
				t.Fatalf("reason %q, want it to mention %q", d.Reason, tc.why)
			}
		})
	}
}

func TestParse(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		want string // substring of the error; "" = no error
	}{
		{"action repair", err2(ParseAction("repair")), ""},
		{"action delete", err2(ParseAction("delete")), ""},
		{"action label", err2(ParseAction("label")), ""},
		{"action bad", err2(ParseAction("restart")), `repair action: unknown action "restart"`},
		{"label key", err2(ParseLabelKey("cni.istio.io/uninitialized")), ""},
		{"label key bad", err2(ParseLabelKey("a b")), `label key "a b"`},
		{"label key empty", err2(ParseLabelKey("")), `label key ""`},
		{"label selector", err2(ParseLabelSelector("app in (a,b),!canary")), ""},
		{"label selector empty", err2(ParseLabelSelector("")), ""},
		{"label selector bad", err2(ParseLabelSelector("app=(")), `label selector "app=("`},
		{"field selector", err2(ParseFieldSelector("metadata.namespace!=batch,spec.restartPolicy=Always")), ""},
		{"field selector unknown field", err2(ParseFieldSelector("metadata.labels=x")), `field "metadata.labels" is not a pod field`},
		{"field selector bad", err2(ParseFieldSelector("a==b==c")), `field selector "a==b==c"`},
		{"message", err2(ParseMessage("^iptables")), ""},
		{"message bad", err2(ParseMessage("(")), `message pattern "("`},
		{"exit code", err2(ParseExitCode(126)), ""},
		{"exit code 0", err2(ParseExitCode(0)), "want 1 to 255"},
		{"exit code 256", err2(ParseExitCode(256)), "want 1 to 255"},
		{"init container", err2(ParseInitContainer("istio-validation")), ""},
		{"init container bad", err2(ParseInitContainer("Istio_Validation")), `init container name "Istio_Validation"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.want == "" {
				if tc.err != nil {
					t.Fatalf("unexpected error %v", tc.err)
				}
				return
			}
			if tc.err == nil || !strings.Contains(tc.err.Error(), tc.want) {
				t.Fatalf("error %v, want %q", tc.err, tc.want)
			}
		})
	}
}

func err2[T any](_ T, err error) error { return err }
