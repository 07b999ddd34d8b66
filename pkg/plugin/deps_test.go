package plugin_test

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
)

// TestPluginLinksNoKubernetes keeps the plugin binary free of Kubernetes' Go
// packages: k8s.io/api and apimachinery would add their package init and size to
// every exec, and the plugin runs once per pod sandbox for ADD and for DEL. The plugin decodes pods into capture.Pod; converting corev1
// pods (capture/k8spod) is for the agent and meshcnictl only. Nor does it link an
// HTTPS client (crypto/tls, x509, net/http, YAML), for the same reason; the API
// fallback runs in the helper meshcni-podget (pkg/podget, pkg/podget/helper). The plugin's
// size and start-up, with the commands that measure them: docs/performance.md.
func TestPluginLinksNoKubernetes(t *testing.T) {
	gobin := testutil.RequireBinary(t, "go")
	root, err := testutil.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(gobin, "list", "-deps", "./cmd/meshcni")
	cmd.Dir = root
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list -deps ./cmd/meshcni: %v", err)
	}
	deps := strings.Fields(string(out))
	if len(deps) < 50 || !contains(deps, "github.com/meshcni/meshcni/pkg/plugin") {
		t.Fatalf("go list -deps ./cmd/meshcni listed %d packages, not the plugin's graph", len(deps))
	}
	forbidden := []string{
		"k8s.io/", // api, apimachinery, client-go, klog, utils
		"github.com/meshcni/meshcni/pkg/capture/k8spod", // the corev1 conversion
		"github.com/meshcni/meshcni/pkg/podget/helper",  // the HTTPS client: meshcni-podget's
		"net/http",
		"crypto/tls",
		"crypto/x509",
		"go.yaml.in/",
		"sigs.k8s.io/yaml",
		"github.com/gogo/protobuf/",
		"google.golang.org/protobuf/",
		"github.com/spf13/pflag", // flag parsing: meshcnictl's and the agent's, not the plugin's
		"github.com/spf13/cobra",
		"github.com/cilium/ebpf", // eBPF: the agent's; the plugin reads the netns cookie with getsockopt
		"github.com/meshcni/meshcni/pkg/ebpf/",
	}
	for _, d := range deps {
		for _, f := range forbidden {
			if d == f || strings.HasPrefix(d, f) && (strings.HasSuffix(f, "/") || strings.HasPrefix(d, f+"/")) {
				t.Errorf("cmd/meshcni links %s (forbidden prefix %q); see `go mod why -m` / `go list -deps`", d, f)
			}
		}
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}
