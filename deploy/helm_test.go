// Package deploy_test proves the Helm chart deploy/charts/meshcni and the plain manifests
// rendered from it (deploy/manifests): helm lint and helm template over a matrix of
// values, the schema's rejections, the agent's and the taint controller's own flag
// parsing of the rendered environment, server-side dry-run of every object on the real
// test-bed API server, and manifests that are not stale. See docs/install.md.
package deploy_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/yaml"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
)

// helmVersion is the Helm that hack/helm builds and caches (`make helm`).
const helmVersion = "v3.22.0"

const (
	chartDir = "charts/meshcni"
	// release and namespace of every rendering (the manifests' too).
	release   = "meshcni"
	namespace = "meshcni-system"
)

// helmBinary returns the Helm to test with: $MESHCNI_HELM, else the one hack/helm caches
// under ${XDG_CACHE_HOME:-$HOME/.cache}/meshcni/tools/helm-<version>/helm. Without it the
// test skips, and fails under CI=true.
func helmBinary(t testing.TB) string {
	t.Helper()
	testutil.Unit(t, "helm") // chart tests run helm: not unit tests (make e2e runs them)
	if p := os.Getenv("MESHCNI_HELM"); p != "" {
		if _, err := exec.LookPath(p); err != nil {
			t.Fatalf("MESHCNI_HELM=%s: %v", p, err)
		}
		return p
	}
	p := filepath.Join(cacheRoot(), "tools", "helm-"+helmVersion, "helm")
	if _, err := os.Stat(p); err != nil {
		testutil.Missing(t, "helm %s is not built (%v): run `make helm` or set MESHCNI_HELM", helmVersion, err)
	}
	return p
}

func cacheRoot() string {
	base := os.Getenv("XDG_CACHE_HOME")
	if base == "" {
		home, _ := os.UserHomeDir()
		base = filepath.Join(home, ".cache")
	}
	return filepath.Join(base, "meshcni")
}

// helmEnv keeps Helm away from the user's configuration, cache and repositories.
func helmEnv(dir string) []string {
	env := []string{}
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "HELM_") && !strings.HasPrefix(kv, "KUBECONFIG=") {
			env = append(env, kv)
		}
	}
	return append(env,
		"HELM_CONFIG_HOME="+filepath.Join(dir, "config"),
		"HELM_CACHE_HOME="+filepath.Join(dir, "cache"),
		"HELM_DATA_HOME="+filepath.Join(dir, "data"),
		"KUBECONFIG="+filepath.Join(dir, "no-kubeconfig"),
	)
}

var helmHome = filepath.Join(os.TempDir(), fmt.Sprintf("meshcni-deploy-helm-%d", os.Getpid()))

// runHelm runs helm with args and returns its stdout; err carries stderr.
func runHelm(t testing.TB, args ...string) (string, error) {
	t.Helper()
	bin := helmBinary(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = helmEnv(helmHome)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.String(), fmt.Errorf("helm %s: %w\n%s%s", strings.Join(args, " "), err, stderr.String(), stdout.String())
	}
	return stdout.String(), nil
}

// templateArgs are the arguments of `helm template` for a set of values: @file is
// --values file, json:key=JSON is --set-json, --flag=x is passed as is, else --set.
func templateArgs(ns string, values []string) []string {
	args := []string{"template", release, chartDir, "--namespace", ns}
	for _, v := range values {
		if f, ok := strings.CutPrefix(v, "@"); ok {
			args = append(args, "--values", f)
		} else if j, ok := strings.CutPrefix(v, "json:"); ok {
			args = append(args, "--set-json", j)
		} else if strings.HasPrefix(v, "--") {
			args = append(args, v) // a helm flag, e.g. --kube-version
		} else {
			args = append(args, "--set", v)
		}
	}
	return args
}

// render runs helm template and parses its output.
func render(t testing.TB, ns string, values []string) (string, []*unstructured.Unstructured) {
	t.Helper()
	return renderArgs(t, templateArgs(ns, values))
}

// renderArgs runs helm with args (a template command) and parses its output.
func renderArgs(t testing.TB, args []string) (string, []*unstructured.Unstructured) {
	t.Helper()
	out, err := runHelm(t, args...)
	if err != nil {
		t.Fatal(err)
	}
	objs, err := parseObjects(out)
	if err != nil {
		t.Fatalf("parse helm template output: %v\n%s", err, out)
	}
	return out, objs
}

// parseObjects splits a multi-document YAML stream into objects (empty documents skipped).
func parseObjects(s string) ([]*unstructured.Unstructured, error) {
	dec := yaml.NewYAMLOrJSONDecoder(strings.NewReader(s), 4096)
	var objs []*unstructured.Unstructured
	for {
		var m map[string]any
		if err := dec.Decode(&m); err != nil {
			if errors.Is(err, io.EOF) {
				return objs, nil
			}
			return nil, err
		}
		if len(m) == 0 {
			continue
		}
		u := &unstructured.Unstructured{Object: m}
		if u.GetKind() == "" || u.GetAPIVersion() == "" || u.GetName() == "" {
			return nil, fmt.Errorf("document without kind, apiVersion or name: %v", m)
		}
		objs = append(objs, u)
	}
}

// TestHelmVersionMatchesScript: the version the tests look for is the one hack/helm builds.
func TestHelmVersionMatchesScript(t *testing.T) {
	b, err := os.ReadFile("../hack/helm")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`version="\$\{HELM_VERSION:-(v[0-9.]+)\}"`).FindSubmatch(b)
	if m == nil {
		t.Fatal("hack/helm: no default HELM_VERSION found")
	}
	if string(m[1]) != helmVersion {
		t.Fatalf("hack/helm builds %s, the tests look for %s", m[1], helmVersion)
	}
}

func TestMain(m *testing.M) {
	code := m.Run()
	_ = os.RemoveAll(helmHome)
	_ = os.RemoveAll(imageDir)
	os.Exit(code)
}
