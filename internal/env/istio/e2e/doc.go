// Package e2e proves meshcni under the real Istio on the test bed: istiod's own
// sidecar injector (pilot.cni.enabled=true) mutates the pods, Istio's own
// pilot-agent runs the istio-validation init container and the istio-proxy
// sidecar (with the Envoy stand-in of internal/standin/proxysim speaking xDS to istiod
// through it), and meshcni's plugin, installed with its own chart, writes the
// redirect. Its tests need root, the test bed and `hack/istio build`; they skip
// without them and fail under CI=true.
package e2e
