package main

import (
	"context"
	"os/exec"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"github.com/meshcni/meshcni/internal/env/demo"
	"github.com/meshcni/meshcni/internal/env/istio"
	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/meshcnictl/precheck"
)

// TestParseIstioInjectorChart reads injector ConfigMaps rendered by Istio's own
// istio-discovery chart (helm template, the Istio build the test bed installs) with
// the values an operator sets: what precheck reports is what the chart's values say
// and what its sidecar template appends for Multus.
func TestParseIstioInjectorChart(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	b, err := istio.Lookup(ctx)
	if err != nil {
		testutil.Missing(t, "%v", err)
	}
	root, err := testbed.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	helm, err := demo.HelmPath(ctx, root)
	if err != nil {
		testutil.Missing(t, "helm: %v", err)
	}
	for _, tc := range []struct {
		name string
		set  []string
		want precheck.Injector
	}{
		{"defaults", nil, precheck.Injector{Revision: "default", CNIProvider: "default", ProxyInitImage: "docker.io/istio/proxyv2:1.0.0"}},
		{"cni", []string{"pilot.cni.enabled=true"},
			precheck.Injector{Revision: "default", CNIEnabled: true, CNIProvider: "default", ProxyInitImage: "docker.io/istio/proxyv2:1.0.0"}},
		{"multus revision distroless", []string{"pilot.cni.enabled=true", "pilot.cni.provider=multus", "revision=canary", "global.variant=distroless", "global.hub=registry.local/istio", "global.tag=1.29.1"},
			precheck.Injector{Revision: "canary", CNIEnabled: true, CNIProvider: "multus", MultusNetwork: precheck.DefaultMultusNetwork, ProxyInitImage: "registry.local/istio/proxyv2:1.29.1-distroless"}},
		{"proxy_init image reference", []string{"global.proxy_init.image=registry.local/mesh/meshcni:0.3.0"},
			precheck.Injector{Revision: "default", CNIProvider: "default", ProxyInitImage: "registry.local/mesh/meshcni:0.3.0"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := []string{"template", "istiod", b.Chart("istio-discovery"), "--namespace", istio.Namespace,
				"--show-only", "templates/istiod-injector-configmap.yaml", "--set", "global.hub=docker.io/istio", "--set", "global.tag=1.0.0"}
			for _, s := range tc.set {
				args = append(args, "--set", s)
			}
			out, err := exec.CommandContext(ctx, helm, args...).CombinedOutput()
			if err != nil {
				t.Fatalf("helm %s: %v\n%s", strings.Join(args, " "), err, out)
			}
			var cm corev1.ConfigMap
			if err := yaml.Unmarshal(out, &cm); err != nil {
				t.Fatalf("rendered ConfigMap: %v\n%s", err, out)
			}
			got, err := precheck.ParseInjector(&cm)
			if err != nil {
				t.Fatal(err)
			}
			tc.want.ConfigMap = cm.Namespace + "/" + cm.Name
			if got != tc.want {
				t.Errorf("ParseInjector(%s) = %+v\nwant %+v", tc.want.ConfigMap, got, tc.want)
			}
			if !precheck.IsInjectorConfigMap(cm.Name) || cm.Labels["istio.io/rev"] == "" {
				t.Errorf("%s (labels %v): not found as precheck lists injectors", cm.Name, cm.Labels)
			}
		})
	}
}
