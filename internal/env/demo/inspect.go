package demo

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os/exec"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/internal/env/testbed"
)

// InspectReport is the part of `meshcnictl inspect -o json` the demo reads.
type InspectReport struct {
	Pod    string            `json:"pod"`
	Meshed *bool             `json:"meshed"`
	Reason string            `json:"reason"`
	Netns  string            `json:"netns"`
	Live   map[string]string `json:"live"`
	Drift  *struct {
		Missing    []string `json:"missing"`
		Unexpected []string `json:"unexpected"`
	} `json:"drift"`
	Status   string   `json:"status"`
	Problems []string `json:"problems"`
	// Command is the command line that produced it.
	Command string `json:"-"`
}

// Backends returns the backends holding live rules, sorted.
func (r *InspectReport) Backends() []string {
	var ks []string
	for k, v := range r.Live {
		if strings.TrimSpace(v) != "" {
			ks = append(ks, k)
		}
	}
	slices.Sort(ks)
	return ks
}

// runInspect runs the host's meshcnictl (built with the image) the way an operator
// would on the node.
func runInspect(ctx context.Context, meshcnictl, pod string) (*InspectReport, error) {
	args := []string{"inspect", "--kubeconfig", testbed.KubeconfigPath(),
		"--node-name", testbed.NodeName, "--netns-dir", testbed.NetnsDir, Namespace + "/" + pod}
	cmd := exec.CommandContext(ctx, meshcnictl, append([]string{"inspect", "-o", "json"}, args[1:]...)...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var ee *exec.ExitError
	if err != nil && !(errors.As(err, &ee) && ee.ExitCode() == 1) { // 1: drift, still a report
		return nil, fmt.Errorf("meshcnictl inspect %s: %w: %s", pod, err, strings.TrimSpace(stderr.String()))
	}
	var rep InspectReport
	if err := json.Unmarshal(stdout.Bytes(), &rep); err != nil {
		return nil, fmt.Errorf("meshcnictl inspect %s: output %q: %w", pod, stdout.String(), err)
	}
	rep.Command = "meshcnictl " + strings.Join(args, " ")
	return &rep, nil
}

// inspect fills the pods table from meshcnictl inspect and the pods' status.
func (r *runner) inspect(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, r.o.Timeout)
	defer cancel()
	for _, name := range []string{MeshedPod, PlainPod, ServerPod} {
		row := PodRow{Pod: Namespace + "/" + name, IP: r.ips[name].String(), Validation: "-", ProxyConns: -1, Rules: "?"}
		ir, err := runInspect(ctx, r.hostCt, name)
		if err != nil {
			r.fail("%v", err)
		} else {
			row.Meshed = ir.Meshed != nil && *ir.Meshed
			row.Reason = ir.Reason
			row.Rules = "none"
			if b := ir.Backends(); len(b) > 0 {
				row.Rules = strings.Join(b, "+")
			}
			row.Rules += " (" + ir.Status + ")"
		}
		pod, err := r.tb.Client.CoreV1().Pods(Namespace).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			r.fail("get pod %s: %v", name, err)
			continue
		}
		if name == MeshedPod {
			r.rep.Inspect = ir
			row.ProxyConns = r.proxyConns
			row.Validation = Validation(pod)
			if row.Validation != "passed (exit 0)" {
				r.fail("%s: %s init container %s", name, ValidationContainer, row.Validation)
			}
			if ir != nil && (!row.Meshed || ir.Status != "in-sync" || len(ir.Backends()) != 1) {
				r.fail("%s: inspect says meshed=%v status=%s backends=%v problems=%v, want a meshed pod with its rules in sync in one backend",
					name, row.Meshed, ir.Status, ir.Backends(), ir.Problems)
			}
		} else if ir != nil && (row.Meshed || ir.Status != "not-meshed") {
			r.fail("%s: inspect says meshed=%v status=%s, want not meshed and no meshcni rule", name, row.Meshed, ir.Status)
		}
		r.rep.Pods = append(r.rep.Pods, row)
	}
	r.step("meshcnictl inspect of each pod")
}

// ValidationPassed is Validation's result for an init container that passed on its
// first run.
const ValidationPassed = "passed (exit 0)"

// Validation says how the pod's istio-validation init container ended: "missing",
// "not finished", ValidationPassed, or "failed (exit N, M restarts)".
func Validation(pod *corev1.Pod) string {
	for _, s := range pod.Status.InitContainerStatuses {
		if s.Name != ValidationContainer {
			continue
		}
		t := s.State.Terminated
		if t == nil {
			t = s.LastTerminationState.Terminated
		}
		if t == nil {
			return "not finished"
		}
		if t.ExitCode == 0 && s.RestartCount == 0 {
			return ValidationPassed
		}
		return fmt.Sprintf("failed (exit %d, %d restarts)", t.ExitCode, s.RestartCount)
	}
	return "missing"
}

// uninstall removes the demo app and meshcni, and checks that the agent took the
// plugin out of the node on its way out.
func (r *runner) uninstall(ctx context.Context) error {
	if err := Down(ctx, r.tb, r.o.RepoRoot, r.helm, r.o.Timeout); err != nil {
		return err
	}
	r.step("uninstalled: demo namespace, helm release, plugin removed from the node by the agent")
	return nil
}

// Down removes the demo namespace and the meshcni release (helm uninstall) from a
// running test bed, and waits until the agent removed the plugin from the node's CNI
// configuration. helm is the Helm binary ("" = hack/helm --path). It does nothing
// that is already done.
func Down(ctx context.Context, tb *testbed.Testbed, repoRoot, helm string, timeout time.Duration) error {
	if timeout == 0 {
		timeout = 2 * time.Minute
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if err := deleteNamespace(ctx, tb, Namespace); err != nil {
		return err
	}
	if helm == "" {
		var err error
		if helm, err = helmPath(ctx, repoRoot); err != nil {
			return err
		}
	}
	r := &runner{tb: tb, helm: helm}
	if _, err := r.runHelm(ctx, "uninstall", Release, "--namespace", ReleaseNamespace, "--ignore-not-found", "--wait"); err != nil {
		return err
	}
	// The agent removes the binary and its entry on SIGTERM (its DaemonSet is gone).
	for {
		bin, entry, err := pluginState("")
		if err == nil && !bin && !entry {
			break
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("after helm uninstall the node still has the plugin (binary %v, entry %v, err %v)", bin, entry, err)
		case <-time.After(100 * time.Millisecond):
		}
	}
	return deleteNamespace(ctx, tb, ReleaseNamespace)
}
