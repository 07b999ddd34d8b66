package demo

import (
	"strconv"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/tools/build/image"
)

// Names of the demo's objects.
const (
	// Namespace holds the demo app.
	Namespace = "meshcni-demo"
	// MeshedPod has an Istio-style sidecar (the redirect is applied by meshcni's
	// plugin); PlainPod is the same app without one; ServerPod is a plain TCP server.
	MeshedPod = "meshed"
	PlainPod  = "plain"
	ServerPod = "server"

	// AppContainer, ProxyContainer and ValidationContainer are the containers of the
	// meshed pod (Istio's names for the last two).
	AppContainer        = "app"
	ProxyContainer      = "istio-proxy"
	ValidationContainer = "istio-validation"
	ServerContainer     = "echo"

	// AppPort is where the app listens in the meshed and the plain pod.
	AppPort = 9080
	// AppUID is the app's UID; ProxyUID is Istio's proxy UID (exempt from the redirect).
	AppUID   = 1000
	ProxyUID = 1337

	// ProxyStatus is the sidecar.istio.io/status annotation Istio's injector writes.
	ProxyStatus = `{"initContainers":["istio-validation"],"containers":["istio-proxy"],"volumes":[],"imagePullSecrets":null,"revision":"default"}`
)

// proxysimPath is the stand-in proxy in its own image; meshcnictlPath is meshcnictl
// in the meshcni image (the validation init container).
var (
	proxysimPath   = image.ProxysimPath
	meshcnictlPath = image.PathInImage("meshcnictl")
)

func runAs(uid int64) *corev1.SecurityContext {
	f := false
	t := true
	return &corev1.SecurityContext{
		RunAsUser:                &uid,
		RunAsGroup:               &uid,
		RunAsNonRoot:             &t,
		AllowPrivilegeEscalation: &f,
		ReadOnlyRootFilesystem:   &t,
		Capabilities:             &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
	}
}

// appContainer is the demo app: meshcni-proxysim in record mode on AppPort, which
// answers each connection with one JSON line saying who connected (and logs it). It
// needs no capability: that is the point of meshcni.
func appContainer(proxysimImage string) corev1.Container {
	return corev1.Container{
		Name:            AppContainer,
		Image:           proxysimImage,
		ImagePullPolicy: corev1.PullNever,
		Command: []string{proxysimPath, "serve", "--mode=record",
			"--outbound-port=0", "--inbound-port=" + strconv.Itoa(AppPort), "--ipv6=false"},
		Ports:           []corev1.ContainerPort{{Name: "app", ContainerPort: AppPort, Protocol: corev1.ProtocolTCP}},
		SecurityContext: runAs(AppUID),
	}
}

func labels(name string) map[string]string {
	return map[string]string{"app": name, "app.kubernetes.io/part-of": "meshcni-demo"}
}

// Pods returns the demo's pods for the meshcni image ref (the validation init
// container) and the stand-in proxy's image ref (the app and the istio-proxy).
func Pods(image, proxysimImage string) []*corev1.Pod {
	zero := int64(0)
	server := testbed.EchoPod(ServerPod, 0)
	server.Namespace = Namespace
	server.Labels = labels(ServerPod)

	plain := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: PlainPod, Namespace: Namespace, Labels: labels(PlainPod)},
		Spec: corev1.PodSpec{
			TerminationGracePeriodSeconds: &zero,
			Containers:                    []corev1.Container{appContainer(proxysimImage)},
		},
	}

	meshed := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name: MeshedPod, Namespace: Namespace, Labels: labels(MeshedPod),
			Annotations: map[string]string{"sidecar.istio.io/status": ProxyStatus},
		},
		Spec: corev1.PodSpec{
			TerminationGracePeriodSeconds: &zero,
			InitContainers: []corev1.Container{{
				// Istio's istio-validation: proves the redirect is in place before the
				// app starts, without NET_ADMIN (exit 126 otherwise).
				Name:            ValidationContainer,
				Image:           image,
				ImagePullPolicy: corev1.PullNever,
				Command:         []string{meshcnictlPath, "validate", "--probe-timeout=10s"},
				SecurityContext: runAs(ProxyUID),
			}},
			Containers: []corev1.Container{
				appContainer(proxysimImage),
				{
					// The stand-in for Envoy: accepts on 15001 (outbound) and 15006
					// (inbound), reads each connection's original destination, logs it
					// and forwards the bytes there (inbound from 127.0.0.6, as Envoy).
					Name:            ProxyContainer,
					Image:           proxysimImage,
					ImagePullPolicy: corev1.PullNever,
					Command:         []string{proxysimPath, "serve", "--mode=forward", "--ipv6=false"},
					Args:            []string{},
					SecurityContext: runAs(ProxyUID),
				},
			},
		},
	}
	return []*corev1.Pod{server, plain, meshed}
}
