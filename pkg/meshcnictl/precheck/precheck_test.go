package precheck

import (
	"fmt"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// injectorCM is an injector ConfigMap shaped as Istio's istio-discovery chart
// renders it (values: JSON of global, sidecarInjectorWebhook, revision, pilot.cni/env;
// config: YAML whose templates.sidecar appends the Multus network).
func injectorCM(rev string, cniEnabled bool, provider, proxyInit string) corev1.ConfigMap {
	name := InjectorConfigMap
	if rev != "" {
		name += "-" + rev
	}
	values := fmt.Sprintf(`{"global":{"hub":"docker.io/istio","tag":"1.29.0","proxy_init":{"image":%q}},
  "pilot":{"cni":{"enabled":%v,"provider":%q},"env":{}},"revision":%q,"sidecarInjectorWebhook":{}}`, proxyInit, cniEnabled, provider, rev)
	config := "defaultTemplates: [sidecar]\npolicy: enabled\ntemplates:\n  sidecar: |\n" +
		"    metadata:\n      annotations: {\n" +
		"    {{- if eq .Values.pilot.cni.provider \"multus\" }}\n" +
		"        k8s.v1.cni.cncf.io/networks: '{{ appendMultusNetwork (index .ObjectMeta.Annotations `k8s.v1.cni.cncf.io/networks`) `default/istio-cni` }}',\n" +
		"    {{- end }}\n      }\n"
	return corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: "istio-system", Name: name},
		Data: map[string]string{"values": values, "config": config}}
}

func node(name string) corev1.Node { return corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}} }

func cniPod(lbls map[string]string, nodeName string, ready bool) corev1.Pod {
	st := corev1.ConditionFalse
	if ready {
		st = corev1.ConditionTrue
	}
	return corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "kube-system", Name: "cni-" + nodeName, Labels: lbls},
		Spec:       corev1.PodSpec{NodeName: nodeName},
		Status:     corev1.PodStatus{Phase: corev1.PodRunning, Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: st}}},
	}
}

var (
	istioLabels = map[string]string{"k8s-app": "istio-cni-node"}
	meshLabels  = map[string]string{"app.kubernetes.io/name": "meshcni", "app.kubernetes.io/component": "agent", "app.kubernetes.io/instance": "meshcni"}
	// withIstioLabel: meshcni's agent with the label istiod's untaint controller selects.
	withIstioLabel = map[string]string{"app.kubernetes.io/name": "meshcni", "app.kubernetes.io/component": "agent", "k8s-app": "istio-cni-node"}
)

func ds(ns, name string, lbls map[string]string, env ...corev1.EnvVar) appsv1.DaemonSet {
	return appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: appsv1.DaemonSetSpec{Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: lbls},
			Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Env: env}}}}}}
}

func meshedPod(name string, inits ...string) corev1.Pod {
	p := corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "app", Name: name, Annotations: map[string]string{statusAnnotation: "{}"}},
		Spec:   corev1.PodSpec{Containers: []corev1.Container{{Name: "app"}, {Name: proxyContainer}}},
		Status: corev1.PodStatus{Phase: corev1.PodRunning}}
	for _, n := range inits {
		p.Spec.InitContainers = append(p.Spec.InitContainers, corev1.Container{Name: n})
	}
	return p
}

func standalone(network string) []corev1.EnvVar {
	env := []corev1.EnvVar{{Name: "MESHCNI_CHAINED", Value: "false"}}
	if network != "" {
		env = append(env, corev1.EnvVar{Name: NetworkNameEnv, Value: network})
	}
	return env
}

func TestRun(t *testing.T) {
	istioNAD := NetworkAttachment{Namespace: "default", Name: "istio-cni", Labels: map[string]string{"operator.istio.io/component": "Cni"}}
	ownNAD := NetworkAttachment{Namespace: "default", Name: "istio-cni", Labels: map[string]string{"app.kubernetes.io/name": "meshcni"}}
	for _, tc := range []struct {
		name string
		in   Input
		// want are substrings of the findings' lines, each in its own finding, in
		// the order of the findings (blockers first).
		want     []string
		blockers int
	}{{
		name: "istio-cni everywhere, meshcni not installed: nothing at risk yet",
		in: Input{
			Nodes:              []corev1.Node{node("n1"), node("n2")},
			DaemonSets:         []appsv1.DaemonSet{ds("istio-system", "istio-cni-node", istioLabels)},
			Pods:               []corev1.Pod{cniPod(istioLabels, "n1", true), cniPod(istioLabels, "n2", true), meshedPod("web", validationContainer)},
			InjectorConfigMaps: []corev1.ConfigMap{injectorCM("", true, "default", "proxyv2")},
		},
		want: []string{
			"INFO     Istio's istio-cni is installed: DaemonSet istio-system/istio-cni-node, Ready on nodes n1, n2",
			"INFO     meshcni is not installed",
			"pilot.cni.enabled=true, pilot.cni.provider=default, proxy-init image docker.io/istio/proxyv2:1.29.0: new pods get istio-validation",
			"only istio-cni redirects on nodes n1, n2  => install meshcni",
		},
	}, {
		name: "mid-switch: both on n1, meshcni not Ready on n2",
		in: Input{
			Nodes:              []corev1.Node{node("n1"), node("n2")},
			DaemonSets:         []appsv1.DaemonSet{ds("istio-system", "istio-cni-node", istioLabels), ds("meshcni", "meshcni-agent", meshLabels)},
			Pods:               []corev1.Pod{cniPod(istioLabels, "n1", true), cniPod(istioLabels, "n2", true), cniPod(meshLabels, "n1", true), cniPod(meshLabels, "n2", false)},
			InjectorConfigMaps: []corev1.ConfigMap{injectorCM("", true, "default", "proxyv2")},
		},
		want: []string{
			"WARNING  meshcni's pod is not Ready on node n2",
			"WARNING  meshcni's agent is not Ready on node n2, which istio-cni alone covers",
			"meshcni is installed: DaemonSet meshcni/meshcni-agent, Ready on node n1",
			"istio-cni and meshcni are both Ready on node n1",
		},
	}, {
		name: "meshcni's agent labelled k8s-app=istio-cni-node (istiod's untaint controller) is not istio-cni",
		in: Input{
			Nodes:              []corev1.Node{node("n1")},
			DaemonSets:         []appsv1.DaemonSet{ds("meshcni", "meshcni-agent", withIstioLabel)},
			Pods:               []corev1.Pod{cniPod(withIstioLabel, "n1", true)},
			InjectorConfigMaps: []corev1.ConfigMap{injectorCM("", true, "default", "proxyv2")},
		},
		want: []string{"Istio's istio-cni is not installed", "meshcni is installed: DaemonSet meshcni/meshcni-agent, Ready on node n1", "only meshcni redirects on node n1"},
	}, {
		name: "istio-cni removed before meshcni is on n2: blocker",
		in: Input{
			Nodes:              []corev1.Node{node("n1"), node("n2"), {ObjectMeta: metav1.ObjectMeta{Name: "cordoned"}, Spec: corev1.NodeSpec{Unschedulable: true}}},
			DaemonSets:         []appsv1.DaemonSet{ds("meshcni", "meshcni-agent", meshLabels)},
			Pods:               []corev1.Pod{cniPod(meshLabels, "n1", true)},
			InjectorConfigMaps: []corev1.ConfigMap{injectorCM("", true, "default", "proxyv2")},
		},
		want:     []string{"BLOCKER  no CNI redirect is Ready on node n2 while the injector relies on one", "only meshcni redirects on node n1"},
		blockers: 1,
	}, {
		name: "pilot.cni.enabled=false on a revision: new pods get istio-init",
		in: Input{
			Nodes:              []corev1.Node{node("n1")},
			DaemonSets:         []appsv1.DaemonSet{ds("meshcni", "meshcni-agent", meshLabels)},
			Pods:               []corev1.Pod{cniPod(meshLabels, "n1", true), meshedPod("old", initContainer), meshedPod("odd")},
			InjectorConfigMaps: []corev1.ConfigMap{injectorCM("", true, "default", "proxyv2"), injectorCM("canary", false, "", "gcr.io/x/proxyv2:1.30")},
		},
		want: []string{
			"BLOCKER  injector istio-system/istio-sidecar-injector-canary (revision canary): pilot.cni.enabled=false, pilot.cni.provider=default, proxy-init image gcr.io/x/proxyv2:1.30: new pods get the privileged istio-init",
			"WARNING  1 meshed pod(s) carry the privileged istio-init, which wrote their rules itself: app/old",
			"WARNING  1 meshed pod(s) have no istio-validation init container: nothing checked their redirect when they started: app/odd",
		},
		blockers: 1,
	}, {
		name: "no CNI needed: no injector, no node finding",
		in:   Input{Nodes: []corev1.Node{node("n1")}},
		want: []string{"WARNING  no istio-sidecar-injector ConfigMap", "Istio's istio-cni is not installed", "meshcni is not installed"},
	}, {
		name: "Multus: meshcni's standalone network differs from the injector's",
		in: Input{
			Nodes:              []corev1.Node{node("n1")},
			DaemonSets:         []appsv1.DaemonSet{ds("meshcni", "meshcni-agent", meshLabels, standalone("")...)},
			Pods:               []corev1.Pod{cniPod(meshLabels, "n1", true)},
			InjectorConfigMaps: []corev1.ConfigMap{injectorCM("", true, "multus", "proxyv2")},
			NetworkAttachments: []NetworkAttachment{istioNAD},
		},
		want: []string{
			"BLOCKER  injector istio-system/istio-sidecar-injector writes Multus network default/istio-cni, meshcni's standalone network is meshcni",
			"WARNING  NetworkAttachmentDefinition default/istio-cni belongs to Istio's istio-cni chart",
			"meshcni is installed: DaemonSet meshcni/meshcni-agent, Ready on node n1, standalone (Multus) network meshcni",
			"Multus network default/istio-cni",
		},
		blockers: 1,
	}, {
		name: "Multus: meshcni answers to istio-cni, its own NAD",
		in: Input{
			Nodes:              []corev1.Node{node("n1")},
			DaemonSets:         []appsv1.DaemonSet{ds("meshcni", "meshcni-agent", meshLabels, standalone("istio-cni")...)},
			Pods:               []corev1.Pod{cniPod(meshLabels, "n1", true)},
			InjectorConfigMaps: []corev1.ConfigMap{injectorCM("", true, "multus", "proxyv2")},
			NetworkAttachments: []NetworkAttachment{ownNAD},
		},
		want: []string{"standalone (Multus) network istio-cni", "Multus network default/istio-cni"},
	}, {
		name: "Multus: the network's NAD is gone",
		in: Input{
			Nodes:              []corev1.Node{node("n1")},
			DaemonSets:         []appsv1.DaemonSet{ds("meshcni", "meshcni-agent", meshLabels, standalone("istio-cni")...)},
			Pods:               []corev1.Pod{cniPod(meshLabels, "n1", true)},
			InjectorConfigMaps: []corev1.ConfigMap{injectorCM("", true, "multus", "proxyv2")},
			NetworkAttachments: []NetworkAttachment{},
		},
		want:     []string{"BLOCKER  injected pods name Multus network default/istio-cni but no NetworkAttachmentDefinition default/istio-cni exists"},
		blockers: 1,
	}, {
		name: "Multus asked for, not served",
		in: Input{
			Nodes:              []corev1.Node{node("n1")},
			DaemonSets:         []appsv1.DaemonSet{ds("meshcni", "meshcni-agent", meshLabels, corev1.EnvVar{Name: "MESHCNI_CHAINED", Value: "true"})},
			Pods:               []corev1.Pod{cniPod(meshLabels, "n1", true)},
			InjectorConfigMaps: []corev1.ConfigMap{injectorCM("", true, "multus", "proxyv2")},
		},
		want: []string{
			"WARNING  injector istio-system/istio-sidecar-injector asks Multus for network default/istio-cni but meshcni is chained into the primary network",
			"WARNING  injector istio-system/istio-sidecar-injector asks Multus for network default/istio-cni but the API server serves no NetworkAttachmentDefinitions",
		},
	}, {
		name: "meshcni standalone, injector without Multus",
		in: Input{
			Nodes:              []corev1.Node{node("n1")},
			DaemonSets:         []appsv1.DaemonSet{ds("meshcni", "meshcni-agent", meshLabels, standalone("")...)},
			Pods:               []corev1.Pod{cniPod(meshLabels, "n1", true)},
			InjectorConfigMaps: []corev1.ConfigMap{injectorCM("", true, "default", "proxyv2")},
		},
		want:     []string{"BLOCKER  meshcni runs standalone (network meshcni, for Multus) but injector istio-system/istio-sidecar-injector uses pilot.cni.provider=default"},
		blockers: 1,
	}, {
		name: "unparsable injector values",
		in: Input{InjectorConfigMaps: []corev1.ConfigMap{{ObjectMeta: metav1.ObjectMeta{Namespace: "istio-system", Name: InjectorConfigMap},
			Data: map[string]string{"values": "{"}}}},
		want: []string{"WARNING  injector ConfigMap istio-system/istio-sidecar-injector: values: unexpected end of JSON input"},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			r := Run(tc.in)
			var lines []string
			for _, f := range r.Findings {
				lines = append(lines, f.String())
			}
			next := 0
			for _, w := range tc.want {
				found := false
				for next < len(lines) && !found {
					found = strings.Contains(lines[next], w)
					next++
				}
				if !found {
					t.Errorf("no finding %q (in this order) among:\n%s", w, strings.Join(lines, "\n"))
				}
			}
			if r.Blockers != tc.blockers {
				t.Errorf("%d blockers, want %d:\n%s", r.Blockers, tc.blockers, strings.Join(lines, "\n"))
			}
		})
	}
}

func TestProxyInitImage(t *testing.T) {
	for _, tc := range []struct {
		image, tag, variant, want string
	}{
		{"", "1.29.0", "", "docker.io/istio/proxyv2:1.29.0"},
		{"proxyv2", "1.29.0-distroless", "", "docker.io/istio/proxyv2:1.29.0-distroless"},
		{"proxyv2", "1.29.0-distroless", "debug", "docker.io/istio/proxyv2:1.29.0-debug"},
		{"proxyv2", "1.29.0-debug", "default", "docker.io/istio/proxyv2:1.29.0"},
		{"registry.local/istio/proxyv2@sha256:ab", "1.29.0", "debug", "registry.local/istio/proxyv2@sha256:ab"},
	} {
		var v injectorValues
		v.Global.Hub, v.Global.Tag, v.Global.Variant, v.Global.ProxyInit.Image = "docker.io/istio", tc.tag, tc.variant, tc.image
		if got := proxyInitImage(v); got != tc.want {
			t.Errorf("proxyInitImage(image %q, tag %q, variant %q) = %q, want %q", tc.image, tc.tag, tc.variant, got, tc.want)
		}
	}
}

func TestMultusNetwork(t *testing.T) {
	for _, tc := range []struct{ config, want string }{
		{"templates:\n  sidecar: \"{{ appendMultusNetwork (index .ObjectMeta.Annotations `k8s.v1.cni.cncf.io/networks`) `kube-system/meshcni` }}\"\n", "kube-system/meshcni"},
		{"templates:\n  sidecar: \"metadata: {}\"\n", ""},
		{"templates: {}\n", DefaultMultusNetwork},
	} {
		got, err := multusNetwork(tc.config)
		if err != nil || got != tc.want {
			t.Errorf("multusNetwork(%q) = %q, %v; want %q", tc.config, got, err, tc.want)
		}
	}
	if _, err := multusNetwork("templates: ["); err == nil {
		t.Error("multusNetwork of broken YAML: no error")
	}
}
