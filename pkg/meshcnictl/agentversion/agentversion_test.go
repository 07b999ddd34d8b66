package agentversion

import (
	"context"
	"errors"
	"io"
	"net/http/httptest"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/pkg/buildinfo"
)

func TestDecode(t *testing.T) {
	for _, tc := range []struct {
		body    string
		want    buildinfo.Info
		wantErr string
	}{
		{`{"version":"0.3.0","goVersion":"go1.26.8","platform":"linux/amd64"}`, buildinfo.Info{Version: "0.3.0", GoVersion: "go1.26.8", Platform: "linux/amd64"}, ""},
		{`{"version":"dev","extra":1}`, buildinfo.Info{Version: "dev"}, ""},
		{`{"goVersion":"go1.26.8"}`, buildinfo.Info{}, `no "version"`},
		{`404 page not found`, buildinfo.Info{}, "parse /version"},
	} {
		got, err := Decode([]byte(tc.body))
		if tc.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("Decode(%q) = %+v, %v; want error with %q", tc.body, got, err, tc.wantErr)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("Decode(%q) = %+v, %v; want %+v", tc.body, got, err, tc.want)
		}
	}
}

func TestImageVersion(t *testing.T) {
	for in, want := range map[string]string{
		"ghcr.io/meshcni/meshcni:0.3.0":                 "0.3.0",
		"registry.local:5000/meshcni/meshcni:0.3.0":     "0.3.0",
		"registry.local:5000/meshcni/meshcni":           "unknown",
		"ghcr.io/meshcni/meshcni:0.3.0@sha256:0123abcd": "0.3.0",
		"ghcr.io/meshcni/meshcni@sha256:0123abcd":       "sha256:0123abcd",
		"meshcni": "unknown",
		"":        "unknown",
	} {
		if got := ImageVersion(in); got != want {
			t.Errorf("ImageVersion(%q) = %q, want %q", in, got, want)
		}
	}
}

func agentPod(name, node string, phase corev1.PodPhase, port int32) corev1.Pod {
	c := corev1.Container{Name: "agent", Image: "meshcni.local/meshcni:dev"}
	if port != 0 {
		c.Ports = []corev1.ContainerPort{{Name: PortName, ContainerPort: port}}
	}
	return corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "meshcni", Name: name},
		Spec: corev1.PodSpec{NodeName: node, Containers: []corev1.Container{c}}, Status: corev1.PodStatus{Phase: phase}}
}

func TestCollect(t *testing.T) {
	pods := []corev1.Pod{
		agentPod("a-old", "n2", corev1.PodRunning, 9807),
		agentPod("a-new", "n1", corev1.PodRunning, 9900),
		agentPod("a-pending", "n3", corev1.PodPending, 9807),
	}
	var asked []string
	fetch := func(_ context.Context, pod *corev1.Pod, port int, path string) ([]byte, error) {
		asked = append(asked, pod.Name+":"+path)
		if pod.Name == "a-new" && port == 9900 {
			return []byte(`{"version":"0.4.0","goVersion":"go1.26.8","platform":"linux/arm64"}`), nil
		}
		return nil, errors.New("404 Not Found")
	}
	got := Collect(context.Background(), pods, fetch)
	want := []Node{
		{Node: "n1", Pod: "meshcni/a-new", Image: "meshcni.local/meshcni:dev", Version: "0.4.0", GoVersion: "go1.26.8", Platform: "linux/arm64", Source: FromAgent},
		{Node: "n2", Pod: "meshcni/a-old", Image: "meshcni.local/meshcni:dev", Version: "dev", Source: FromImage,
			Note: "the agent did not answer GET /version on port 9807 (404 Not Found): version of its image"},
		{Node: "n3", Pod: "meshcni/a-pending", Image: "meshcni.local/meshcni:dev", Version: "dev", Source: FromImage,
			Note: "the agent did not answer GET /version on port 9807 (pod is pending): version of its image"},
	}
	if len(got) != len(want) {
		t.Fatalf("Collect = %+v", got)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("Collect[%d] = %+v\nwant %+v", i, got[i], want[i])
		}
	}
	if strings.Join(asked, " ") != "a-old:version a-new:version" {
		t.Errorf("asked %v; want the running pods only", asked)
	}
}

// TestDecodeAgentHandler: what the agent serves on GET /version (buildinfo's
// handler) is what Decode reads.
func TestDecodeAgentHandler(t *testing.T) {
	srv := httptest.NewServer(buildinfo.Info{Version: "0.4.1", GoVersion: "go1.26.8", Platform: "linux/arm64"}.Handler())
	defer srv.Close()
	resp, err := srv.Client().Get(srv.URL + "/" + Path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	got, err := Decode(body)
	if want := (buildinfo.Info{Version: "0.4.1", GoVersion: "go1.26.8", Platform: "linux/arm64"}); err != nil || got != want {
		t.Fatalf("Decode(%q) = %+v, %v; want %+v", body, got, err, want)
	}
}
