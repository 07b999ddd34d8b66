package istio_test

// The validation-free template, applied the way Istio's injector applies a template
// (pkg/kube/inject applyOverlayYAML: the rendered template as a strategic merge patch
// onto the pod, with corev1.Pod's patch metadata), to pods as the "sidecar" template
// renders them. The real injector (webhook and istioctl kube-inject) is exercised by
// internal/env/istio/e2e TestIstioValidationFree.

import (
	"bytes"
	"encoding/json"
	"os"
	"slices"
	"strings"
	"testing"
	"text/template"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/strategicpatch"
	"sigs.k8s.io/yaml"
)

const templateName = "meshcni-validation-free"

func loadTemplate(t *testing.T) string {
	t.Helper()
	raw, err := os.ReadFile("validation-free-values.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var v struct {
		SidecarInjectorWebhook struct {
			Templates        map[string]string `json:"templates"`
			DefaultTemplates []string          `json:"defaultTemplates"`
		} `json:"sidecarInjectorWebhook"`
	}
	if err := yaml.UnmarshalStrict(raw, &v); err != nil {
		t.Fatalf("validation-free-values.yaml: %v", err)
	}
	if len(v.SidecarInjectorWebhook.DefaultTemplates) != 0 {
		t.Errorf("the snippet sets defaultTemplates %v: it would replace the operator's list", v.SidecarInjectorWebhook.DefaultTemplates)
	}
	tpl, ok := v.SidecarInjectorWebhook.Templates[templateName]
	if !ok || len(v.SidecarInjectorWebhook.Templates) != 1 {
		t.Fatalf("templates %v, want exactly %s", v.SidecarInjectorWebhook.Templates, templateName)
	}
	// The injector runs every template through text/template first.
	var out bytes.Buffer
	if err := template.Must(template.New(templateName).Parse(tpl)).Execute(&out, map[string]any{}); err != nil {
		t.Fatal(err)
	}
	return out.String()
}

// overlay is Istio's applyOverlayYAML.
func overlay(t *testing.T, pod *corev1.Pod, patchYAML string) *corev1.Pod {
	t.Helper()
	meta, err := strategicpatch.NewPatchMetaFromStruct(corev1.Pod{})
	if err != nil {
		t.Fatal(err)
	}
	cur, err := json.Marshal(pod)
	if err != nil {
		t.Fatal(err)
	}
	var orig, patch map[string]any
	if err := json.Unmarshal(cur, &orig); err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal([]byte(patchYAML), &patch); err != nil {
		t.Fatal(err)
	}
	res, err := strategicpatch.StrategicMergeMapPatchUsingLookupPatchMeta(orig, patch, meta)
	if err != nil {
		t.Fatalf("strategic merge: %v", err)
	}
	b, err := json.Marshal(res)
	if err != nil {
		t.Fatal(err)
	}
	var out corev1.Pod
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatal(err)
	}
	return &out
}

func names(cs []corev1.Container) []string {
	var n []string
	for _, c := range cs {
		n = append(n, c.Name)
	}
	return n
}

func TestValidationFreeTemplate(t *testing.T) {
	tpl := loadTemplate(t)
	always := corev1.ContainerRestartPolicyAlways
	proxy := corev1.Container{Name: "istio-proxy", Image: "proxyv2", Args: []string{"proxy", "sidecar"}, RestartPolicy: &always}
	validation := corev1.Container{Name: "istio-validation", Image: "proxyv2", Args: []string{"istio-iptables", "--run-validation", "--skip-rule-apply"}}
	initC := corev1.Container{Name: "istio-init", Image: "proxyv2", Args: []string{"istio-iptables"}}
	app := corev1.Container{Name: "app", Image: "app"}
	userInit := corev1.Container{Name: "migrate", Image: "app"}
	for _, tc := range []struct {
		name         string
		inits, conts []corev1.Container
		wantI, wantC []string
	}{
		{"native sidecar (CNI mode)", []corev1.Container{validation, proxy, userInit}, []corev1.Container{app}, []string{"istio-proxy", "migrate"}, []string{"app"}},
		{"sidecar container (CNI mode)", []corev1.Container{validation, userInit}, []corev1.Container{app, {Name: "istio-proxy", Image: "proxyv2"}}, []string{"migrate"}, []string{"app", "istio-proxy"}},
		{"istio-init is left alone", []corev1.Container{initC, proxy}, []corev1.Container{app}, []string{"istio-init", "istio-proxy"}, []string{"app"}},
		{"no istio-validation: no change", []corev1.Container{proxy}, []corev1.Container{app}, []string{"istio-proxy"}, []string{"app"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pod := &corev1.Pod{Spec: corev1.PodSpec{InitContainers: tc.inits, Containers: tc.conts}}
			got := overlay(t, pod, tpl)
			if gi, gc := names(got.Spec.InitContainers), names(got.Spec.Containers); !slices.Equal(gi, tc.wantI) || !slices.Equal(gc, tc.wantC) {
				t.Errorf("init containers %q, containers %q; want %q, %q", gi, gc, tc.wantI, tc.wantC)
			}
			for _, c := range append(got.Spec.InitContainers, got.Spec.Containers...) {
				for _, w := range append(tc.inits, tc.conts...) {
					if c.Name == w.Name && (c.Image != w.Image || strings.Join(c.Args, " ") != strings.Join(w.Args, " ")) {
						t.Errorf("%s changed: %+v, was %+v", c.Name, c, w)
					}
				}
			}
		})
	}
}
