package testbed

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	//lint:ignore SA1019 client-go v0.37 remotecommand still takes this type
	"k8s.io/apimachinery/pkg/util/httpstream"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/remotecommand"

	"github.com/meshcni/meshcni/pkg/netnsutil"
)

// EchoPod returns a pod running EchoImage (imagePullPolicy Never) in namespace
// "default", listening on EchoPort, with a hostPort mapping when hostPort > 0 (so
// the portmap plugin is exercised).
func EchoPod(name string, hostPort int32) *corev1.Pod {
	port := corev1.ContainerPort{Name: "echo", ContainerPort: EchoPort, Protocol: corev1.ProtocolTCP}
	if hostPort > 0 {
		port.HostPort = hostPort
	}
	zero := int64(0)
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default", Labels: map[string]string{"app": name}},
		Spec: corev1.PodSpec{
			TerminationGracePeriodSeconds: &zero,
			Containers: []corev1.Container{{
				Name:            "echo",
				Image:           EchoImage,
				ImagePullPolicy: corev1.PullNever,
				Ports:           []corev1.ContainerPort{port},
				ReadinessProbe: &corev1.Probe{
					ProbeHandler:  corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Port: intOrString(EchoPort)}},
					PeriodSeconds: 1,
				},
			}},
		},
	}
}

// CreatePod creates pod (namespace "default" when empty).
func (tb *Testbed) CreatePod(ctx context.Context, pod *corev1.Pod) (*corev1.Pod, error) {
	if pod.Namespace == "" {
		pod = pod.DeepCopy()
		pod.Namespace = "default"
	}
	p, err := tb.Client.CoreV1().Pods(pod.Namespace).Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("create pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	return p, nil
}

// DeletePod deletes a pod immediately and waits until it is gone.
func (tb *Testbed) DeletePod(ctx context.Context, namespace, name string) error {
	zero := int64(0)
	err := tb.Client.CoreV1().Pods(namespace).Delete(ctx, name, metav1.DeleteOptions{GracePeriodSeconds: &zero})
	if ignoreNotFound(err) != nil {
		return fmt.Errorf("delete pod %s/%s: %w", namespace, name, err)
	}
	return poll(ctx, 200*time.Millisecond, func() error {
		_, err := tb.Client.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
		if err == nil {
			return errors.New("still there")
		}
		return ignoreNotFound(err)
	})
}

// CreateNamespace creates a namespace and waits for its default ServiceAccount
// (pods cannot be created before it exists). API-only, with no controller-manager
// to make it, it creates the ServiceAccount itself.
func (tb *Testbed) CreateNamespace(ctx context.Context, name string) error {
	_, err := tb.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("create namespace %s: %w", name, err)
	}
	if tb.Mode == ModeAPIOnly {
		sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: name, Name: "default"}}
		if _, err := tb.Client.CoreV1().ServiceAccounts(name).Create(ctx, sa, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("create the default ServiceAccount of %s: %w", name, err)
		}
		return nil
	}
	return poll(ctx, 100*time.Millisecond, func() error {
		_, err := tb.Client.CoreV1().ServiceAccounts(name).Get(ctx, "default", metav1.GetOptions{})
		return err
	})
}

// badWaiting are container waiting reasons that will not fix themselves.
var badWaiting = map[string]bool{
	"ErrImageNeverPull": true, "ErrImagePull": true, "ImagePullBackOff": true, "InvalidImageName": true,
	"CrashLoopBackOff": true, "CreateContainerError": true, "CreateContainerConfigError": true, "RunContainerError": true,
}

// WaitPodReady waits until the pod's Ready condition is true. It fails early, with
// the pod's events, when the pod fails or a container is stuck (image missing,
// crash loop, sandbox errors).
func (tb *Testbed) WaitPodReady(ctx context.Context, namespace, name string) (*corev1.Pod, error) {
	return tb.waitPod(ctx, namespace, name, func(p *corev1.Pod) bool {
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
				return true
			}
		}
		return false
	})
}

// WaitPodRunning waits until the pod is in phase Running (or Succeeded).
func (tb *Testbed) WaitPodRunning(ctx context.Context, namespace, name string) (*corev1.Pod, error) {
	return tb.waitPod(ctx, namespace, name, func(p *corev1.Pod) bool {
		return p.Status.Phase == corev1.PodRunning || p.Status.Phase == corev1.PodSucceeded
	})
}

func (tb *Testbed) waitPod(ctx context.Context, namespace, name string, done func(*corev1.Pod) bool) (*corev1.Pod, error) {
	var pod *corev1.Pod
	sandboxFailures := 0
	err := poll(ctx, 100*time.Millisecond, func() error {
		p, err := tb.Client.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		pod = p
		if done(p) {
			return nil
		}
		if p.Status.Phase == corev1.PodFailed {
			return errStop{fmt.Errorf("pod failed: %s %s", p.Status.Reason, p.Status.Message)}
		}
		for _, cs := range append(append([]corev1.ContainerStatus{}, p.Status.InitContainerStatuses...), p.Status.ContainerStatuses...) {
			if w := cs.State.Waiting; w != nil && badWaiting[w.Reason] {
				return errStop{fmt.Errorf("container %s: %s: %s", cs.Name, w.Reason, w.Message)}
			}
		}
		// Repeated sandbox failures (CNI errors) do not fix themselves either.
		if evs, err := tb.Client.CoreV1().Events(namespace).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + name}); err == nil {
			sandboxFailures = 0
			for _, e := range evs.Items {
				if e.Reason == "FailedCreatePodSandBox" {
					sandboxFailures += int(max(e.Count, 1))
				}
			}
			if sandboxFailures >= 3 {
				return errStop{errors.New("pod sandbox creation keeps failing")}
			}
		}
		return fmt.Errorf("phase %s", p.Status.Phase)
	})
	if err != nil {
		return pod, fmt.Errorf("wait for pod %s/%s: %w\n%s", namespace, name, err, tb.describePod(context.WithoutCancel(ctx), namespace, name))
	}
	return pod, nil
}

// errStop ends poll early.
type errStop struct{ error }

// describePod renders the pod's status and events for error messages.
func (tb *Testbed) describePod(ctx context.Context, namespace, name string) string {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var b strings.Builder
	if p, err := tb.Client.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{}); err == nil {
		fmt.Fprintf(&b, "pod %s/%s phase=%s ip=%s\n", namespace, name, p.Status.Phase, p.Status.PodIP)
		for _, cs := range p.Status.ContainerStatuses {
			fmt.Fprintf(&b, "  container %s ready=%v restarts=%d state=%+v\n", cs.Name, cs.Ready, cs.RestartCount, cs.State)
		}
	}
	if evs, err := tb.Client.CoreV1().Events(namespace).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + name}); err == nil {
		sort.Slice(evs.Items, func(i, j int) bool { return evs.Items[i].LastTimestamp.Before(&evs.Items[j].LastTimestamp) })
		for _, e := range evs.Items {
			fmt.Fprintf(&b, "  event %s %s (x%d): %s\n", e.Type, e.Reason, e.Count, e.Message)
		}
	}
	return b.String()
}

// PodLogs returns a container's log through the API server (what `kubectl logs`
// does). container may be empty for single-container pods.
func (tb *Testbed) PodLogs(ctx context.Context, namespace, name, container string) (string, error) {
	b, err := tb.Client.CoreV1().Pods(namespace).GetLogs(name, &corev1.PodLogOptions{Container: container}).DoRaw(ctx)
	if err != nil {
		return "", fmt.Errorf("logs of %s/%s: %w", namespace, name, err)
	}
	return string(b), nil
}

// Exec runs a command in a container through the API server (what `kubectl exec`
// does: WebSocket, falling back to SPDY) and returns its stdout and stderr. A
// non-zero exit is an error.
func (tb *Testbed) Exec(ctx context.Context, namespace, name, container string, command ...string) (stdout, stderr string, err error) {
	req := tb.Client.CoreV1().RESTClient().Post().Resource("pods").Namespace(namespace).Name(name).SubResource("exec").
		VersionedParams(&corev1.PodExecOptions{Container: container, Command: command, Stdout: true, Stderr: true}, scheme.ParameterCodec)
	ws, err := remotecommand.NewWebSocketExecutor(tb.RESTConfig, "GET", req.URL().String())
	if err != nil {
		return "", "", fmt.Errorf("exec: %w", err)
	}
	spdy, err := remotecommand.NewSPDYExecutor(tb.RESTConfig, "POST", req.URL())
	if err != nil {
		return "", "", fmt.Errorf("exec: %w", err)
	}
	exec, err := remotecommand.NewFallbackExecutor(ws, spdy, func(err error) bool {
		return httpstream.IsUpgradeFailure(err) || httpstream.IsHTTPSProxyError(err)
	})
	if err != nil {
		return "", "", fmt.Errorf("exec: %w", err)
	}
	var o, e bytes.Buffer
	err = exec.StreamWithContext(ctx, remotecommand.StreamOptions{Stdout: &o, Stderr: &e})
	if err != nil {
		return o.String(), e.String(), fmt.Errorf("exec %v in %s/%s: %w (stderr: %s)", command, namespace, name, err, strings.TrimSpace(e.String()))
	}
	return o.String(), e.String(), nil
}

// PodNetns returns the host path of a running pod's network namespace, found
// through the runtime (CRI sandbox status) of the pod's node.
func (tb *Testbed) PodNetns(ctx context.Context, namespace, name string) (string, error) {
	p, err := tb.Client.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return "", fmt.Errorf("pod %s/%s: %w", namespace, name, err)
	}
	node := tb.nodeOfPod(p)
	if p.Spec.HostNetwork {
		return node.Netns(), nil
	}
	cri, err := dialCRIAt(node.criSocket())
	if err != nil {
		return "", err
	}
	defer cri.Close()
	path, err := cri.podNetns(ctx, string(p.UID))
	if err != nil {
		return "", fmt.Errorf("netns of pod %s/%s: %w", namespace, name, err)
	}
	if strings.HasPrefix(path, "/proc/") { // a pid: the nodes share the host's pid namespace
		return path, nil
	}
	return node.HostPath(path), nil
}

// InPodNetns runs fn on a locked OS thread inside the pod's network namespace
// (netnsutil.Do): sockets opened and netlink calls made by fn happen there.
func (tb *Testbed) InPodNetns(ctx context.Context, namespace, name string, fn func() error) error {
	path, err := tb.PodNetns(ctx, namespace, name)
	if err != nil {
		return err
	}
	return netnsutil.Do(path, fn)
}

// WaitDaemonSet waits until a DaemonSet's pods are all scheduled, updated and
// available.
func (tb *Testbed) WaitDaemonSet(ctx context.Context, namespace, name string) (*appsv1.DaemonSet, error) {
	var ds *appsv1.DaemonSet
	err := poll(ctx, 100*time.Millisecond, func() error {
		d, err := tb.Client.AppsV1().DaemonSets(namespace).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		ds = d
		s := d.Status
		if d.Generation <= s.ObservedGeneration && s.DesiredNumberScheduled > 0 &&
			s.UpdatedNumberScheduled == s.DesiredNumberScheduled && s.NumberAvailable == s.DesiredNumberScheduled {
			return nil
		}
		return fmt.Errorf("desired=%d updated=%d available=%d", s.DesiredNumberScheduled, s.UpdatedNumberScheduled, s.NumberAvailable)
	})
	if err != nil {
		return ds, fmt.Errorf("wait for daemonset %s/%s: %w", namespace, name, err)
	}
	return ds, nil
}

func intOrString(port int) intstr.IntOrString { return intstr.FromInt32(int32(port)) }
