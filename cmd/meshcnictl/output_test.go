package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/meshcni/meshcni/internal/testkit/golden"
)

// TestExplainOutput checks explain -o json|yaml against golden files
// (testdata/explain; rewrite with -update).
func TestExplainOutput(t *testing.T) {
	gd := golden.Open(t, filepath.Join("testdata", "explain"))
	plain := strings.Replace(meshedPodYAML, "  - name: istio-proxy\n    image: proxyv2\n    args: [proxy, sidecar]\n", "", 1)
	for _, tc := range []struct {
		name, manifest string
		args           []string
	}{
		{"meshed.json", meshedPodYAML, []string{"-o", "json"}},
		{"meshed.yaml", meshedPodYAML, []string{"-o", "yaml"}},
		{"dual-stack-tproxy.yaml", strings.Replace(dualStackPodYAML, "    traffic.sidecar.istio.io/excludeOutboundPorts", "    sidecar.istio.io/interceptionMode: TPROXY\n    traffic.sidecar.istio.io/excludeOutboundPorts", 1), []string{"-o", "yaml"}},
		{"not-meshed.yaml", plain, []string{"-o", "yaml"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, err := runExplain(t, tc.manifest, tc.args...)
			if err != nil {
				t.Fatal(err)
			}
			gd.Check(t, tc.name, []byte(out))
		})
	}
	if _, err := runExplain(t, meshedPodYAML, "-o", "wide"); err == nil || !strings.Contains(err.Error(), `-o "wide": want text, json or yaml`) {
		t.Errorf("-o wide: %v", err)
	}
}

// TestNamespaceDefault: without -n, a pod name is looked up in the kubeconfig
// context's namespace (the API server here refuses the connection: the error names
// the pod it asked for).
func TestNamespaceDefault(t *testing.T) {
	kc := filepath.Join(t.TempDir(), "kubeconfig")
	cfg := `apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u, namespace: shop}}]
current-context: x
`
	if err := os.WriteFile(kc, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"explain", "--kubeconfig", kc, "--timeout", "2s", "web"}, "get pod shop/web"},
		{[]string{"explain", "--kubeconfig", kc, "--timeout", "2s", "-n", "app", "web"}, "get pod app/web"},
		{[]string{"explain", "--kubeconfig", kc, "--timeout", "2s", "batch/web"}, "get pod batch/web"},
		{[]string{"inspect", "--kubeconfig", kc, "--timeout", "2s", "web"}, "get pod shop/web"},
	} {
		_, _, err := ctl(t, tc.args...)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v; want an error with %q", tc.args, err, tc.want)
		}
	}
}

func TestVersionClient(t *testing.T) {
	for _, v := range []string{"", "1.2.3"} {
		version = v
		out, code, err := ctl(t, "version", "--client", "-o", "json")
		if err != nil || code != 0 {
			t.Fatalf("version --client: exit %d, %v", code, err)
		}
		var r versionReport
		if err := json.Unmarshal([]byte(out), &r); err != nil {
			t.Fatalf("%v\n%s", err, out)
		}
		want := v
		if v == "" {
			want = "dev" // go test stamps no module version
		}
		if r.Kind != versionKind || r.APIVersion != "meshcni.io/v1alpha1" || r.Client.Version != want || r.Client.GoVersion == "" || r.Client.Platform == "" || r.Agents != nil {
			t.Errorf("version --client (main.version %q): %+v", v, r)
		}
		out, _, _ = ctl(t, "version", "--client")
		if !strings.HasPrefix(out, "client: meshcnictl "+want+" (go") {
			t.Errorf("version --client: %q", out)
		}
	}
	version = ""
}

func TestPrecheckUsage(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"precheck", "-o", "wide"}, `-o "wide"`},
		{[]string{"precheck", "extra"}, "unknown command"},
		{[]string{"precheck", "--kubeconfig", "/nonexistent/kubeconfig"}, "kubeconfig /nonexistent/kubeconfig"},
	} {
		_, code, err := ctl(t, tc.args...)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: exit %d, %v; want %q", tc.args, code, err, tc.want)
		}
	}
}
