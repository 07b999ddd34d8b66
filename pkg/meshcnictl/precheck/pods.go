package precheck

import (
	"fmt"

	corev1 "k8s.io/api/core/v1"

	"github.com/meshcni/meshcni/pkg/capture"
)

// Names of the containers and annotations Istio's injector adds.
const (
	proxyContainer      = capture.ProxyContainer
	initContainer       = capture.InitContainer
	validationContainer = "istio-validation" // with pilot.cni.enabled=true
	statusAnnotation    = capture.AnnotationStatus
	interceptionModeKey = capture.AnnotationInterceptionMode
)

// meshed reports whether a pod has Istio's sidecar (a container, or a native
// sidecar init container, named istio-proxy; or the injector's status annotation)
// and its traffic is to be intercepted.
func meshed(pod *corev1.Pod) bool {
	if pod.Annotations[interceptionModeKey] == "NONE" {
		return false
	}
	_, injected := pod.Annotations[statusAnnotation]
	return injected || hasContainer(pod.Spec.Containers, proxyContainer) || hasContainer(pod.Spec.InitContainers, proxyContainer)
}

func hasContainer(cs []corev1.Container, name string) bool {
	for _, c := range cs {
		if c.Name == name {
			return true
		}
	}
	return false
}

// podFindings name the live meshed pods whose redirect the switch does not
// re-check: those with istio-init (their own rules) and those with no init container
// of Istio at all.
func podFindings(pods []corev1.Pod) []Finding {
	var withInit, unchecked []string
	for i := range pods {
		pod := &pods[i]
		if pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed || !meshed(pod) {
			continue
		}
		id := pod.Namespace + "/" + pod.Name
		switch {
		case hasContainer(pod.Spec.InitContainers, initContainer):
			withInit = append(withInit, id)
		case !hasContainer(pod.Spec.InitContainers, validationContainer):
			unchecked = append(unchecked, id)
		}
	}
	var fs []Finding
	if len(withInit) > 0 {
		fs = append(fs, Finding{Severity: Warning, Check: "pods",
			What: fmt.Sprintf("%d meshed pod(s) carry the privileged istio-init, which wrote their rules itself: %s", len(withInit), listOr(withInit, "")),
			Do:   "they keep their redirect through the switch; restart their workloads (kubectl rollout restart) once pilot.cni.enabled=true to drop istio-init"})
	}
	if len(unchecked) > 0 {
		fs = append(fs, Finding{Severity: Warning, Check: "pods",
			What: fmt.Sprintf("%d meshed pod(s) have no istio-validation init container: nothing checked their redirect when they started: %s", len(unchecked), listOr(unchecked, "")),
			Do:   "check each with meshcnictl inspect on its node, or restart its workload after the switch"})
	}
	return fs
}
