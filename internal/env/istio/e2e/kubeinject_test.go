package e2e

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/meshcni/meshcni/internal/env/istio"
	"github.com/meshcni/meshcni/internal/env/testbed"
)

const kubeInjectNamespace = "istio-e2e-kube-inject"

// TestIstioKubeInject: `istioctl kube-inject` (Istio's own, offline: the running
// istiod's injection template, values and mesh config read from its ConfigMaps into
// files) injects a client and a server Deployment; applied to a namespace WITHOUT
// the injection label (the webhook does not touch them), they are handled as the
// webhook's pods are: istio-validation exits 0, Ready through 15021, client → server
// captured on 15001 and 15006.
func TestIstioKubeInject(t *testing.T) {
	tb := upParallel(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	if err := tb.CreateNamespace(ctx, kubeInjectNamespace); err != nil {
		t.Fatal(err)
	}
	useNamespace(t, tb, kubeInjectNamespace)
	var ds []*appsv1.Deployment
	for _, name := range []string{"server", "client"} {
		d := kubeInject(ctx, t, tb, appDeployment(kubeInjectNamespace, name, kubeInjectTemplates()))
		if _, ok := d.Spec.Template.Annotations["sidecar.istio.io/status"]; !ok {
			t.Fatalf("istioctl kube-inject output has no sidecar.istio.io/status: %+v", d.Spec.Template.Annotations)
		}
		ds = append(ds, d)
	}
	ns, err := tb.Client.CoreV1().Namespaces().Get(ctx, kubeInjectNamespace, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if v, ok := ns.Labels["istio-injection"]; ok {
		t.Fatalf("namespace %s has istio-injection=%s", kubeInjectNamespace, v)
	}
	pods, took := createDeployments(ctx, t, tb, ds...)
	t.Logf("kube-injected pods Ready %s after the Deployments were created", took.Round(time.Millisecond))
	for _, p := range pods {
		checkInjected(t, p)
		checkProxyLog(ctx, t, tb, p)
	}
	checkTraffic(ctx, t, tb, &istio.App{Namespace: kubeInjectNamespace, Client: pods["client"], Server: pods["server"]})
}

// kubeInject runs `istioctl kube-inject` on d with the running istiod's injection
// configuration (ConfigMaps istio-sidecar-injector: config, values; istio: mesh)
// and returns the injected Deployment.
func kubeInject(ctx context.Context, t *testing.T, tb *testbed.Testbed, d *appsv1.Deployment) *appsv1.Deployment {
	t.Helper()
	dir := t.TempDir()
	files := map[string]string{}
	for _, f := range []struct{ cm, key, flag string }{
		{"istio-sidecar-injector", "config", "--injectConfigFile"},
		{"istio-sidecar-injector", "values", "--valuesFile"},
		{"istio", "mesh", "--meshConfigFile"},
	} {
		cm, err := tb.Client.CoreV1().ConfigMaps(istio.Namespace).Get(ctx, f.cm, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		path := filepath.Join(dir, f.cm+"-"+f.key)
		if err := os.WriteFile(path, []byte(cm.Data[f.key]), 0o600); err != nil {
			t.Fatal(err)
		}
		files[f.flag] = path
	}
	in, err := yaml.Marshal(d)
	if err != nil {
		t.Fatal(err)
	}
	inFile := filepath.Join(dir, d.Name+".yaml")
	if err := os.WriteFile(inFile, in, 0o600); err != nil {
		t.Fatal(err)
	}
	args := []string{"kube-inject", "-f", inFile, "--kubeconfig", testbed.KubeconfigPath()}
	for flag, path := range files {
		args = append(args, flag, path)
	}
	cmd := exec.CommandContext(ctx, upInst.Build.Bin("istioctl"), args...)
	var stderr []byte
	out, err := cmd.Output()
	if ee, ok := err.(*exec.ExitError); ok {
		stderr = ee.Stderr
	}
	if err != nil {
		t.Fatalf("istioctl %q: %v: %s", args, err, stderr)
	}
	var got appsv1.Deployment
	if err := yaml.Unmarshal(out, &got); err != nil {
		t.Fatalf("istioctl kube-inject output: %v\n%s", err, out)
	}
	got.Namespace = d.Namespace
	return &got
}

// kubeInjectTemplates is the pod annotation that makes `istioctl kube-inject` apply
// the test bed's hostAliases template after Istio's sidecar template (offline
// injection ignores the injector's defaultTemplates; the test bed has no cluster DNS
// for pilot-agent to find istiod by name).
func kubeInjectTemplates() map[string]string {
	return map[string]string{"inject.istio.io/templates": "sidecar," + istio.HostAliasesTemplate}
}

// podOf is a bare Pod with a Deployment's pod template.
func podOf(d *appsv1.Deployment, name string) *corev1.Pod {
	tpl := d.Spec.Template.DeepCopy()
	tpl.ObjectMeta.Name, tpl.ObjectMeta.Namespace = name, d.Namespace
	return &corev1.Pod{ObjectMeta: tpl.ObjectMeta, Spec: tpl.Spec}
}
