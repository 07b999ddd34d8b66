package k8spod

import (
	"encoding/json"
	"reflect"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/pkg/capture"
)

func i64(v int64) *int64 { return &v }

func fullPod() *corev1.Pod {
	always := corev1.ContainerRestartPolicyAlways
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: "app", Name: "web", UID: "uid-1",
			Labels:          map[string]string{"app": "web", capture.AnnotationInject: "true"},
			Annotations:     map[string]string{capture.AnnotationStatus: "{}", capture.AnnotationMirror: "uid-0"},
			ResourceVersion: "42",
		},
		Spec: corev1.PodSpec{
			NodeName:    "node-1",
			HostNetwork: true,
			InitContainers: []corev1.Container{
				{Name: "setup", Image: "busybox", Command: []string{"true"}},
				{Name: capture.ProxyContainer, Image: "istio/proxyv2", RestartPolicy: &always,
					Args: []string{"proxy", "sidecar"},
					Env: []corev1.EnvVar{
						{Name: capture.EnvDNSCapture, Value: "true"},
						{Name: "POD_NAME", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "metadata.name"}}},
					},
					SecurityContext: &corev1.SecurityContext{RunAsUser: i64(1337), RunAsGroup: i64(1338), Privileged: new(bool)},
				},
			},
			Containers: []corev1.Container{{Name: "app", Image: "app", Ports: []corev1.ContainerPort{{ContainerPort: 80}}}},
		},
		Status: corev1.PodStatus{
			Phase: corev1.PodRunning, PodIP: "10.0.0.5",
			PodIPs: []corev1.PodIP{{IP: "10.0.0.5"}, {IP: "fd00::5"}},
		},
	}
}

// TestFromEqualsJSON: the conversion equals decoding the Pod's Kubernetes JSON into
// capture.Pod, which is what the plugin does with the API server's answer; so
// capture.Pod's JSON tags are the API's and From leaves out nothing capture reads.
func TestFromEqualsJSON(t *testing.T) {
	for name, pod := range map[string]*corev1.Pod{
		"full":    fullPod(),
		"minimal": {ObjectMeta: metav1.ObjectMeta{Namespace: "a", Name: "b"}},
		"env valueFrom only": {Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: capture.ProxyContainer,
			Env: []corev1.EnvVar{{Name: capture.EnvDisableEnvoy, ValueFrom: &corev1.EnvVarSource{}}}}}}},
	} {
		t.Run(name, func(t *testing.T) {
			b, err := json.Marshal(pod)
			if err != nil {
				t.Fatal(err)
			}
			var want capture.Pod
			if err := json.Unmarshal(b, &want); err != nil {
				t.Fatal(err)
			}
			got := From(pod)
			if !reflect.DeepEqual(got, &want) {
				t.Errorf("From:\n%+v\nJSON:\n%+v", got, &want)
			}
			// And capture.Pod's own JSON decodes back to itself (the agent's answer).
			b2, err := json.Marshal(got)
			if err != nil {
				t.Fatal(err)
			}
			var back capture.Pod
			if err := json.Unmarshal(b2, &back); err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(&back, got) {
				t.Errorf("round trip:\n%+v\nwant\n%+v", &back, got)
			}
		})
	}
	if From(nil) != nil {
		t.Error("From(nil) != nil")
	}
}

// TestFromFields: what capture reads survives the conversion, and capture derives
// the spec from it.
func TestFromFields(t *testing.T) {
	p := From(fullPod())
	proxy, native := capture.FindProxy(p)
	if proxy == nil || !native {
		t.Fatalf("FindProxy = %v, %v; want the native sidecar", proxy, native)
	}
	if proxy.Env[1].ValueFrom == nil || proxy.Env[0].ValueFrom != nil {
		t.Errorf("valueFrom presence lost: %+v", proxy.Env)
	}
	if *proxy.SecurityContext.RunAsUser != 1337 || *proxy.SecurityContext.RunAsGroup != 1338 {
		t.Errorf("securityContext = %+v", proxy.SecurityContext)
	}
	if !capture.IsRuntimePod(p, "uid-1") || !capture.IsRuntimePod(p, "uid-0") || capture.IsRuntimePod(p, "uid-2") {
		t.Error("IsRuntimePod wrong on the converted pod")
	}
	res, err := capture.Build(p)
	if err != nil {
		t.Fatal(err)
	}
	if !res.Spec.RedirectDNS || res.Spec.ProxyUIDs[0] != 1337 || res.Spec.ProxyGIDs[0] != 1338 {
		t.Errorf("spec = %+v", res.Spec)
	}
}
