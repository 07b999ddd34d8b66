package agent

import (
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/pkg/agentsock"
)

// mapPods is a PodSource for this pure-logic test (the real cache, pkg/nodepods, is
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
		Annotations: map[string]string{mirrorAnnotation: "u-static"}}}
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
		{"hit without UID", synced, agentsock.PodRequest{Namespace: "app", Name: "web"}, "u-web", "", ""},
		{"static pod: mirror annotation UID", synced, agentsock.PodRequest{Namespace: "kube-system", Name: "etcd-n1", UID: "u-static"}, "u-mirror", "", ""},
		{"stale UID", synced, agentsock.PodRequest{Namespace: "app", Name: "web", UID: "u-new"}, "", "has UID u-web, not u-new", ""},
		{"not cached", synced, agentsock.PodRequest{Namespace: "app", Name: "db"}, "", "not in the agent's cache", ""},
		{"not synced", unsynced, agentsock.PodRequest{Namespace: "app", Name: "web"}, "", "not synced yet", ""},
		{"no cache", nil, agentsock.PodRequest{Namespace: "app", Name: "web"}, "", "no pod cache", ""},
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
			var p corev1.Pod
			if !resp.Found || p.Unmarshal(resp.Pod) != nil || string(p.UID) != tc.wantUID || p.Name != tc.req.Name {
				t.Fatalf("got %+v, want pod %s with UID %s", resp, tc.req.Name, tc.wantUID)
			}
		})
	}
}
