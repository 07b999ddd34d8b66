package istio

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/meshcni/meshcni/internal/env/testbed"
)

// ConfigMaps istiod's chart writes: the injector's templates and values, and the
// mesh config.
const (
	InjectorConfigMap = "istio-sidecar-injector"
	MeshConfigMap     = "istio"
)

// Inject renders pod through Istio's injector offline, as `istioctl kube-inject`
// does, from the installed istiod's own injector ConfigMap (templates and values)
// and mesh config, with the values' pilot.cni.enabled set to cni. With cni false
// the injector renders istio-init (root, NET_ADMIN and NET_RAW, pilot-agent
// istio-iptables writing the rules) instead of istio-validation: Istio's privileged
// mode, on the same istiod. The result is to be created in a namespace without
// istio-injection (the webhook would inject it again).
func Inject(ctx context.Context, tb *testbed.Testbed, b Build, pod *corev1.Pod, cni bool) (*corev1.Pod, error) {
	dir, err := os.MkdirTemp("", "meshcni-kube-inject-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	templates, err := writeInjectorFiles(ctx, tb, dir, cni)
	if err != nil {
		return nil, err
	}
	// kube-inject takes only the templates from the file, not its defaultTemplates;
	// the annotation selects those the webhook would apply.
	pod = pod.DeepCopy()
	if _, ok := pod.Annotations[AnnotationTemplates]; !ok && len(templates) > 0 {
		if pod.Annotations == nil {
			pod.Annotations = map[string]string{}
		}
		pod.Annotations[AnnotationTemplates] = strings.Join(templates, ",")
	}
	in, err := yaml.Marshal(pod)
	if err != nil {
		return nil, fmt.Errorf("inject %s: %w", pod.Name, err)
	}
	if err := os.WriteFile(filepath.Join(dir, "pod.yaml"), in, 0o600); err != nil {
		return nil, err
	}
	cmd := exec.CommandContext(ctx, b.Bin("istioctl"), "kube-inject",
		"--injectConfigFile", filepath.Join(dir, "inject.yaml"),
		"--valuesFile", filepath.Join(dir, "values.json"),
		"--meshConfigFile", filepath.Join(dir, "mesh.yaml"),
		"--filename", filepath.Join(dir, "pod.yaml"),
		"--output", filepath.Join(dir, "injected.yaml"))
	cmd.Env = append(os.Environ(), "KUBECONFIG="+testbed.KubeconfigPath())
	if out, err := cmd.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("istioctl kube-inject %s: %w: %s", pod.Name, err, strings.TrimSpace(string(out)))
	}
	raw, err := os.ReadFile(filepath.Join(dir, "injected.yaml"))
	if err != nil {
		return nil, err
	}
	var injected corev1.Pod
	if err := yaml.Unmarshal(raw, &injected); err != nil {
		return nil, fmt.Errorf("istioctl kube-inject %s: output: %w", pod.Name, err)
	}
	return &injected, nil
}

// AnnotationTemplates selects the injector's templates for a pod.
const AnnotationTemplates = "inject.istio.io/templates"

// writeInjectorFiles writes inject.yaml, values.json (pilot.cni.enabled = cni) and
// mesh.yaml from istiod's ConfigMaps into dir, and returns the injector's
// defaultTemplates.
func writeInjectorFiles(ctx context.Context, tb *testbed.Testbed, dir string, cni bool) ([]string, error) {
	cms := tb.Client.CoreV1().ConfigMaps(Namespace)
	inj, err := cms.Get(ctx, InjectorConfigMap, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("injector config: %w", err)
	}
	mesh, err := cms.Get(ctx, MeshConfigMap, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("mesh config: %w", err)
	}
	values, err := withCNI(inj.Data["values"], cni)
	if err != nil {
		return nil, err
	}
	var cfg struct {
		DefaultTemplates []string `json:"defaultTemplates"`
	}
	if err := yaml.Unmarshal([]byte(inj.Data["config"]), &cfg); err != nil {
		return nil, fmt.Errorf("injector config: %w", err)
	}
	for name, content := range map[string]string{
		"inject.yaml": inj.Data["config"], "values.json": values, "mesh.yaml": mesh.Data["mesh"],
	} {
		if content == "" {
			return nil, fmt.Errorf("injector files: %s would be empty (ConfigMaps %s, %s)", name, InjectorConfigMap, MeshConfigMap)
		}
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o600); err != nil {
			return nil, err
		}
	}
	return cfg.DefaultTemplates, nil
}

// withCNI sets pilot.cni.enabled in the injector's values (JSON).
func withCNI(values string, cni bool) (string, error) {
	var v map[string]any
	if err := json.Unmarshal([]byte(values), &v); err != nil {
		return "", fmt.Errorf("injector values: %w", err)
	}
	pilot, _ := v["pilot"].(map[string]any)
	if pilot == nil {
		pilot = map[string]any{}
		v["pilot"] = pilot
	}
	c, _ := pilot["cni"].(map[string]any)
	if c == nil {
		c = map[string]any{}
		pilot["cni"] = c
	}
	c["enabled"] = cni
	out, err := json.Marshal(v)
	if err != nil {
		return "", fmt.Errorf("injector values: %w", err)
	}
	return string(out), nil
}
