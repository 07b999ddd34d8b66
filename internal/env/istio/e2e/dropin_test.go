package e2e

import (
	"os/exec"
	"slices"
	"testing"
	"time"

	"github.com/meshcni/meshcni/internal/testkit/traffic"
	"github.com/meshcni/meshcni/pkg/redirectprobe"
)

// checkDropIn runs meshcnictl with the arguments the real injector gave a pod's
// istio-validation container (Istio's proxy-init command line, leading
// "istio-iptables" word included), as the meshcni image would run them in place of
// Istio's proxy-init image: in a fresh pod network namespace as UID 1337 it exits 126
// (no redirect), the same arguments without the validation flags apply meshcni's
// rules (as istio-init would, as root), and the validation then exits 0.
func checkDropIn(t *testing.T, injected []string) {
	t.Helper()
	bin := traffic.Binary(t, "./cmd/meshcnictl")
	apply := slices.DeleteFunc(slices.Clone(injected), func(a string) bool {
		return a == "--run-validation" || a == "--skip-rule-apply"
	})
	pod := traffic.NewPod(t)
	run := func(cred traffic.Cred, args []string) int {
		cmd := exec.Command(bin, args...)
		cmd.Env = []string{"PROBE_TIMEOUT=1s"} // Istio's variable, shortened
		out, err := traffic.RunCmdInNetns(pod.NetNS, cred, time.Minute, cmd)
		t.Logf("meshcnictl %q as uid %d: %v %s", args, cred.UID, err, out)
		return traffic.ExitCode(err)
	}
	if code := run(traffic.ProxyCred, injected); code != redirectprobe.ExitCode {
		t.Errorf("the injector's istio-validation arguments without a redirect: exit %d, want %d", code, redirectprobe.ExitCode)
	}
	if code := run(traffic.Root, apply); code != 0 {
		t.Fatalf("the same arguments without --run-validation (istio-init): exit %d, want 0", code)
	}
	if code := run(traffic.ProxyCred, injected); code != 0 {
		t.Errorf("the injector's istio-validation arguments on meshcni's rules: exit %d, want 0", code)
	}
}
