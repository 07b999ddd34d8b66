package istio_test

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/meshcni/meshcni/internal/env/istio"
	"github.com/meshcni/meshcni/internal/testkit/reporoot"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
)

// rendered is what the tests read of `istioctl manifest generate`: the injector's
// pilot.cni.enabled and the istio-cni-node DaemonSet's nodeSelector (nil: no
// DaemonSet).
type rendered struct {
	pilotCNI     bool
	nodeSelector map[string]string
}

// TestIstioctlOverlay: docs/migration.md's IstioOperator overlay, rendered offline
// by the pinned istioctl from the module's manifests, keeps the injector in CNI mode
// (pilot.cni.enabled true in the sidecar injector's values) and confines the
// istio-cni-node DaemonSet to the labelled nodes; components.cni.enabled=false, the
// obvious alternative, renders pilot.cni.enabled false and no DaemonSet — why the
// doc keeps the component on.
func TestIstioctlOverlay(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	b, err := istio.Lookup(ctx)
	if err != nil {
		testutil.Missing(t, "%v", err)
	}
	root, err := reporoot.Find()
	if err != nil {
		t.Fatal(err)
	}
	doc, err := os.ReadFile(filepath.Join(root, "docs", "migration.md"))
	if err != nil {
		t.Fatal(err)
	}
	lines, _, err := istio.DocText(doc, "yaml", "istioctl-overlay")
	if err != nil {
		t.Fatal(err)
	}
	mod, err := istio.ModuleDir(ctx)
	if err != nil {
		t.Fatal(err)
	}
	got := generate(ctx, t, b.Bin("istioctl"), mod, strings.Join(lines, "\n"))
	if !got.pilotCNI || got.nodeSelector["meshcni.io/istio-cni"] != "on" {
		t.Errorf("the doc's overlay renders pilot.cni.enabled %v, istio-cni-node nodeSelector %v; want true and meshcni.io/istio-cni=on", got.pilotCNI, got.nodeSelector)
	}
	off := "apiVersion: install.istio.io/v1alpha1\nkind: IstioOperator\nspec:\n  components:\n    cni:\n      enabled: false\n  values:\n    pilot:\n      cni:\n        enabled: true\n"
	if got := generate(ctx, t, b.Bin("istioctl"), mod, off); got.pilotCNI || got.nodeSelector != nil {
		t.Errorf("components.cni.enabled=false renders pilot.cni.enabled %v, DaemonSet %v; want false and none (istioctl derives the value)", got.pilotCNI, got.nodeSelector != nil)
	}
}

func generate(ctx context.Context, t *testing.T, istioctl, mod, overlay string) rendered {
	t.Helper()
	f := filepath.Join(t.TempDir(), "overlay.yaml")
	if err := os.WriteFile(f, []byte(overlay), 0o600); err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, istioctl, "manifest", "generate", "-f", f, "--manifests", filepath.Join(mod, "manifests"))
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("istioctl manifest generate: %v: %s", err, stderr.String())
	}
	var r rendered
	injector := false
	for _, d := range strings.Split(string(out), "\n---\n") {
		var obj struct {
			Kind     string
			Metadata struct{ Name string }
			Data     map[string]string
			Spec     struct {
				Template struct {
					Spec struct{ NodeSelector map[string]string }
				}
			}
		}
		if yaml.Unmarshal([]byte(d), &obj) != nil {
			continue
		}
		switch {
		case obj.Kind == "ConfigMap" && obj.Metadata.Name == "istio-sidecar-injector":
			var v struct {
				Pilot struct{ CNI struct{ Enabled bool } }
			}
			if err := json.Unmarshal([]byte(obj.Data["values"]), &v); err != nil {
				t.Fatalf("istio-sidecar-injector values: %v", err)
			}
			r.pilotCNI, injector = v.Pilot.CNI.Enabled, true
		case obj.Kind == "DaemonSet" && obj.Metadata.Name == istio.CNIDaemonSet:
			r.nodeSelector = obj.Spec.Template.Spec.NodeSelector
			if r.nodeSelector == nil {
				r.nodeSelector = map[string]string{}
			}
		}
	}
	if !injector {
		t.Fatal("istioctl rendered no istio-sidecar-injector ConfigMap")
	}
	return r
}
