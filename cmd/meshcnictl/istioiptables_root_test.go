package main

import (
	"os/exec"
	"reflect"
	"testing"
	"time"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/internal/testkit/traffic"
	"github.com/meshcni/meshcni/pkg/redirectprobe"
)

// The arguments Istio's injection template renders for its proxy-init image
// (manifests/charts/istio-control/istio-discovery/files/injection-template.yaml),
// with the chart's defaults: istio-validation in CNI mode, istio-init otherwise.
var (
	istioValidationArgs = []string{"istio-iptables", "-p", "15001", "-z", "15006", "-u", "1337", "-m", "REDIRECT",
		"-i", "*", "-x", "", "-b", "*", "-d", "15090,15021,15020", "--log_output_level=default:info",
		"--run-validation", "--skip-rule-apply"}
	istioInitArgs = []string{"istio-iptables", "-p", "15001", "-z", "15006", "-u", "1337", "-m", "REDIRECT",
		"-i", "*", "-x", "", "-b", "*", "-d", "15090,15021,15020", "--log_output_level=default:info"}
)

func TestIstioIptablesMode(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want []string
	}{
		{istioValidationArgs[1:], []string{"validate"}},
		{istioInitArgs[1:], []string{"rules", "apply"}},
		{[]string{"--run-validation=true"}, []string{"validate"}},
		{[]string{"--run-validation=false", "-p", "15001"}, []string{"rules", "apply"}},
		{[]string{"--cleanup-only"}, []string{"rules", "clean"}},
		{[]string{"-n", "-p", "15001"}, []string{"rules", "render"}},
		{[]string{"--dry-run"}, []string{"rules", "render"}},
		{[]string{"--", "--run-validation"}, []string{"rules", "apply"}},
		{nil, []string{"rules", "apply"}},
	} {
		if got := istioIptablesMode(tc.args); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("istioIptablesMode(%q) = %q, want %q", tc.args, got, tc.want)
		}
	}
}

// TestIstioIptablesDropIn runs meshcnictl as Istio's proxy-init image would be run,
// with Istio's own arguments: istio-validation (UID 1337, no capability) exits 126 in
// a pod without the redirect; istio-init's arguments (root) apply meshcni's rules;
// the same validation then exits 0; --cleanup-only removes them again.
func TestIstioIptablesDropIn(t *testing.T) {
	testutil.RequireRoot(t)
	bin := traffic.Binary(t, "./cmd/meshcnictl")
	pod := traffic.NewPod(t)
	run := func(cred traffic.Cred, args []string) int {
		t.Helper()
		cmd := exec.Command(bin, args...)
		cmd.Env = []string{"PROBE_TIMEOUT=1s"} // Istio's own variable, shortened for the test
		out, err := traffic.RunCmdInNetns(pod.NetNS, cred, 60*time.Second, cmd)
		t.Logf("meshcnictl %q as uid %d: %v\n%s", args, cred.UID, err, out)
		return traffic.ExitCode(err)
	}
	if code := run(traffic.ProxyCred, istioValidationArgs); code != redirectprobe.ExitCode {
		t.Fatalf("istio-validation without the redirect: exit %d, want %d", code, redirectprobe.ExitCode)
	}
	if code := run(traffic.Root, istioInitArgs); code != 0 {
		t.Fatalf("istio-init's arguments: exit %d, want 0 (rules applied)", code)
	}
	if code := run(traffic.ProxyCred, istioValidationArgs); code != 0 {
		t.Fatalf("istio-validation with meshcni's rules: exit %d, want 0", code)
	}
	cleanup := append(append([]string{}, istioInitArgs...), "--cleanup-only")
	if code := run(traffic.Root, cleanup); code != 0 {
		t.Fatalf("--cleanup-only: exit %d, want 0", code)
	}
	if code := run(traffic.ProxyCred, istioValidationArgs); code != redirectprobe.ExitCode {
		t.Fatalf("istio-validation after --cleanup-only: exit %d, want %d", code, redirectprobe.ExitCode)
	}
}
