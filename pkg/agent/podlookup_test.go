package agent

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/pkg/agent/nodepods"
	"github.com/meshcni/meshcni/pkg/agentsock"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/capture/k8spod"
)

// mapPods is a PodSource for this pure-logic test (the real cache, pkg/agent/nodepods, is
// exercised against the test bed's API server in pkg/plugin's TestAgentPodLookup).
type mapPods struct {
	synced bool
	pods   map[string]*corev1.Pod
}

func (m *mapPods) HasSynced() bool { return m.synced }
func (m *mapPods) Get(ns, name string) (*corev1.Pod, bool) {
	p, ok := m.pods[ns+"/"+name]
	return p, ok
}

func TestAnswerPod(t *testing.T) {
	web := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "app", Name: "web", UID: "u-web"}}
	static := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "kube-system", Name: "etcd-n1", UID: "u-mirror",
		Annotations: map[string]string{capture.AnnotationMirror: "u-static"}}}
	synced := &mapPods{synced: true, pods: map[string]*corev1.Pod{"app/web": web, "kube-system/etcd-n1": static}}
	unsynced := &mapPods{pods: synced.pods}
	for _, tc := range []struct {
		name       string
		pods       PodSource
		req        agentsock.PodRequest
		wantUID    string // "" = not found
		wantReason string
		wantErr    string
	}{
		{"hit", synced, agentsock.PodRequest{Namespace: "app", Name: "web", UID: "u-web"}, "u-web", "", ""},
		{"no UID: miss", synced, agentsock.PodRequest{Namespace: "app", Name: "web"}, "", "no K8S_POD_UID", ""},
		{"static pod: mirror annotation UID", synced, agentsock.PodRequest{Namespace: "kube-system", Name: "etcd-n1", UID: "u-static"}, "u-mirror", "", ""},
		{"stale UID", synced, agentsock.PodRequest{Namespace: "app", Name: "web", UID: "u-new"}, "", "has UID u-web, not u-new", ""},
		{"not cached", synced, agentsock.PodRequest{Namespace: "app", Name: "db", UID: "u-db"}, "", "not in the agent's cache", ""},
		{"not synced", unsynced, agentsock.PodRequest{Namespace: "app", Name: "web", UID: "u-web"}, "", "not synced yet", ""},
		{"no cache", nil, agentsock.PodRequest{Namespace: "app", Name: "web", UID: "u-web"}, "", "no pod cache", ""},
		{"no name", synced, agentsock.PodRequest{Namespace: "app"}, "", "", "without namespace or name"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp, err := AnswerPod(tc.pods, tc.req)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("error %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if tc.wantUID == "" {
				if resp.Found || len(resp.Pod) != 0 || !strings.Contains(resp.Reason, tc.wantReason) {
					t.Fatalf("got %+v, want a miss with %q", resp, tc.wantReason)
				}
				return
			}
			var p capture.Pod
			if !resp.Found || json.Unmarshal(resp.Pod, &p) != nil || p.UID != tc.wantUID || p.Name != tc.req.Name {
				t.Fatalf("got %+v, want pod %s with UID %s", resp, tc.req.Name, tc.wantUID)
			}
		})
	}
}

// TestAnswerPodKeepsWhatThePluginDecidesOn: the pod the agent answers with, taken from
// the cache (which trims it, nodepods.Trim) and sent as the JSON of a capture.Pod,
// decodes to exactly what capture reads of the API's pod, and the plugin's decision
// and spec from it equal those from the pod as the API server returns it: an answer from the agent never changes a redirect.
func TestAnswerPodKeepsWhatThePluginDecidesOn(t *testing.T) {
	uid := int64(1337)
	always := corev1.ContainerRestartPolicyAlways
	api := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "app", Name: "web", UID: "u-web",
			Labels: map[string]string{"app": "web"},
			Annotations: map[string]string{
				capture.AnnotationStatus:                  `{"containers":["istio-proxy"],"initContainers":["istio-validation"]}`,
				capture.AnnotationInterceptionMode:        "TPROXY",
				capture.AnnotationIncludeInboundPorts:     "8080",
				capture.AnnotationExcludeOutboundPorts:    "9000,9001",
				capture.AnnotationExcludeOutboundIPRanges: "10.96.0.1/32",
				capture.AnnotationExcludeInterfaces:       "eth9",
				capture.AnnotationKubevirtInterfaces:      "net1",
			},
			ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "kubectl", Operation: metav1.ManagedFieldsOperationApply}},
		},
		Spec: corev1.PodSpec{
			NodeName: "n1",
			InitContainers: []corev1.Container{{Name: capture.ProxyContainer, Image: "docker.io/istio/proxyv2:1.27.0",
				RestartPolicy: &always,
				Args:          []string{"proxy", "sidecar", "--domain", "app.svc.cluster.local"},
				Env: []corev1.EnvVar{{Name: "ISTIO_META_DNS_CAPTURE", Value: "true"},
					{Name: "ISTIO_META_INTERCEPTION_MODE", Value: "TPROXY"}},
				SecurityContext: &corev1.SecurityContext{RunAsUser: &uid, RunAsGroup: &uid}}},
			Containers: []corev1.Container{{Name: "app", Image: "registry.example/app:1",
				Ports: []corev1.ContainerPort{{ContainerPort: 8080, Protocol: corev1.ProtocolTCP}}}},
		},
	}
	cached, err := nodepods.Trim(api.DeepCopy())
	if err != nil {
		t.Fatal(err)
	}
	pods := &mapPods{synced: true, pods: map[string]*corev1.Pod{"app/web": cached.(*corev1.Pod)}}
	resp, err := AnswerPod(pods, agentsock.PodRequest{Namespace: "app", Name: "web", UID: "u-web"})
	if err != nil || !resp.Found {
		t.Fatalf("AnswerPod = %+v, %v", resp, err)
	}
	var got capture.Pod
	if err := json.Unmarshal(resp.Pod, &got); err != nil {
		t.Fatal(err)
	}
	// The answer holds everything capture reads of the API's pod: the cache's trim
	// keeps it, the JSON of capture.Pod carries it.
	if fromAPI := k8spod.From(api); !reflect.DeepEqual(&got, fromAPI) {
		t.Fatalf("answered pod differs from the API's:\n%+v\n%+v", &got, fromAPI)
	}
	cfg := capture.Config{}
	if a, b := capture.Decide(k8spod.From(api), cfg), capture.Decide(&got, cfg); a != b || !a.Captured() {
		t.Fatalf("decision from the API's pod %+v, from the agent's %+v (want equal and meshed)", a, b)
	}
	want, err := capture.Build(k8spod.From(api))
	if err != nil {
		t.Fatal(err)
	}
	have, err := capture.Build(&got)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(want, have) {
		t.Fatalf("spec from the API's pod:\n%+v\nfrom the agent's:\n%+v", want.Spec, have.Spec)
	}
}
