package multinode

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os/exec"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/internal/env/demo"
	"github.com/meshcni/meshcni/internal/env/testbed"
)

// MeshedPodLabel is on every pod MeshedPod builds (value: the pod's name).
const MeshedPodLabel = "multinode.meshcni.io/meshed"

// MeshedPodSpec is the spec of demo's meshed pod (Istio-style): an
// istio-validation init container running `meshcnictl validate` as UID 1337, the
// app (the stand-in proxy in record mode on demo.AppPort) and an istio-proxy
// container running the stand-in proxy as UID 1337. Pods need the
// sidecar.istio.io/status annotation (MeshedAnnotations) to be meshed.
func (c *Cluster) MeshedPodSpec() corev1.PodSpec {
	for _, p := range demo.Pods(c.MeshcniImage, c.ProxyImage) {
		if p.Name == demo.MeshedPod {
			return *p.Spec.DeepCopy()
		}
	}
	panic("demo.Pods has no meshed pod")
}

// MeshedAnnotations are the annotations Istio's injector leaves on a meshed pod.
func MeshedAnnotations() map[string]string {
	return map[string]string{"sidecar.istio.io/status": demo.ProxyStatus}
}

// MeshedPod is a meshed pod (MeshedPodSpec) called namespace/name, scheduled onto
// node by its kubernetes.io/hostname label (through the scheduler, which honours
// the node's taints); node "" lets the scheduler choose.
func (c *Cluster) MeshedPod(namespace, name, node string) *corev1.Pod {
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace,
			Labels: map[string]string{MeshedPodLabel: name}, Annotations: MeshedAnnotations()},
		Spec: c.MeshedPodSpec(),
	}
	if node != "" {
		p.Spec.NodeSelector = map[string]string{"kubernetes.io/hostname": node}
	}
	return p
}

// MeshedDeployment is a Deployment of meshed pods (MeshedPodSpec, label
// MeshedPodLabel=name), spread over the nodes: at most one pod more on any node
// than on the emptiest (a topology spread constraint on kubernetes.io/hostname,
// DoNotSchedule; a tainted node counts, so pods wait for it rather than pile up
// elsewhere).
func (c *Cluster) MeshedDeployment(namespace, name string, replicas int32) *appsv1.Deployment {
	labels := map[string]string{MeshedPodLabel: name}
	spec := c.MeshedPodSpec()
	spec.TopologySpreadConstraints = []corev1.TopologySpreadConstraint{{
		MaxSkew: 1, TopologyKey: "kubernetes.io/hostname", WhenUnsatisfiable: corev1.DoNotSchedule,
		LabelSelector: &metav1.LabelSelector{MatchLabels: labels},
	}}
	return &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace, Labels: labels},
		Spec: appsv1.DeploymentSpec{
			Replicas: &replicas,
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels, Annotations: MeshedAnnotations()},
				Spec:       spec,
			},
		},
	}
}

// Inspect runs the host's meshcnictl inspect on the pod from its own node: the
// node's CNI configuration (the plugin's settings), the pod's network namespace
// found through the node's runtime (testbed.PodNetns), the node's agent run dir.
func (c *Cluster) Inspect(ctx context.Context, pod *corev1.Pod) (*demo.InspectReport, error) {
	n, err := c.TB.Node(pod.Spec.NodeName)
	if err != nil {
		return nil, err
	}
	netns, err := c.TB.PodNetns(ctx, pod.Namespace, pod.Name)
	if err != nil {
		return nil, err
	}
	args := []string{"inspect", "-o", "json", "--kubeconfig", testbed.KubeconfigPath(),
		"--node-name", n.Name, "--netns", netns, "--cni-conf-dir", n.CNIConfDir(),
		"--agent-run-dir", n.HostPath(AgentRunDir), pod.Namespace + "/" + pod.Name}
	cmd := exec.CommandContext(ctx, c.Meshcnictl, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err = cmd.Run()
	var ee *exec.ExitError
	if err != nil && !(errors.As(err, &ee) && ee.ExitCode() == 1) { // 1: drift, still a report
		return nil, fmt.Errorf("meshcnictl inspect %s/%s on %s: %w: %s", pod.Namespace, pod.Name, n.Name, err, strings.TrimSpace(stderr.String()))
	}
	var rep demo.InspectReport
	if err := json.Unmarshal(stdout.Bytes(), &rep); err != nil {
		return nil, fmt.Errorf("meshcnictl inspect %s/%s: output %q: %w", pod.Namespace, pod.Name, stdout.String(), err)
	}
	rep.Command = "meshcnictl " + strings.Join(args, " ")
	return &rep, nil
}

// Redirected audits a meshed pod from its own node and returns nil when it started
// redirected and still is: running, its istio-validation init container passed on
// its first run (exit 0, no restart: the redirect was in place before the app
// started), and meshcnictl inspect (Inspect) finds it meshed with meshcni's rules
// in sync in exactly one backend. The error lists every way it is not.
func (c *Cluster) Redirected(ctx context.Context, pod *corev1.Pod) error {
	p, err := c.TB.Client.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	id := fmt.Sprintf("pod %s/%s on %s", p.Namespace, p.Name, p.Spec.NodeName)
	if p.Status.Phase != corev1.PodRunning {
		return fmt.Errorf("%s: phase %s, want Running", id, p.Status.Phase)
	}
	var problems []string
	if v := demo.Validation(p); v != demo.ValidationPassed {
		problems = append(problems, "init container "+demo.ValidationContainer+": "+v)
	}
	rep, err := c.Inspect(ctx, p)
	switch {
	case err != nil:
		problems = append(problems, err.Error())
	case rep.Meshed == nil || !*rep.Meshed:
		problems = append(problems, "inspect: not meshed ("+rep.Reason+")")
	case rep.Status != "in-sync" || len(rep.Backends()) != 1:
		problems = append(problems, fmt.Sprintf("inspect: status %s, rules in %v, problems %v; want in-sync in one backend",
			rep.Status, rep.Backends(), rep.Problems))
	}
	if err := errList(problems); err != nil {
		return fmt.Errorf("%s not redirected: %w", id, err)
	}
	return nil
}
