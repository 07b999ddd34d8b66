package deploy_test

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/tools/build/image"
	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/capture/k8spod"
	"github.com/meshcni/meshcni/pkg/engine"
)

// streamNamespace holds the meshed pods created during rolling upgrades.
const streamNamespace = "meshcni-upgrade-stream"

// meshedPod is testbed.EchoPod with Istio's injection (as pkg/agent's test bed test
// makes it): the status annotation and an istio-proxy container (the echo image on the
// excluded port 15021), no readiness probe (it would be redirected to a proxy that is not
// there) and no validation init container, so a pod the plugin did not redirect still
// starts, and the audit sees it.
func meshedPod(name string) *corev1.Pod {
	p := testbed.EchoPod(name, 0)
	p.Namespace = streamNamespace
	p.Annotations = map[string]string{capture.AnnotationStatus: `{"containers":["istio-proxy"]}`}
	p.Spec.Containers[0].ReadinessProbe = nil
	p.Spec.Containers = append(p.Spec.Containers, corev1.Container{
		Name: capture.ProxyContainer, Image: testbed.EchoImage, ImagePullPolicy: corev1.PullNever,
		Env: []corev1.EnvVar{{Name: "PORT", Value: "15021"}},
	})
	return p
}

// validatedPod is meshedPod with Istio's validation init container (meshcnictl validate
// from the meshcni image, UID 1337, no capabilities): started before meshcni is in the
// chain, it exits 126 until the repair controller applies its redirect in place.
func validatedPod(name, meshcniImage string) *corev1.Pod {
	p := meshedPod(name)
	p.Annotations[capture.AnnotationStatus] = `{"initContainers":["istio-validation"],"containers":["istio-proxy"]}`
	uid, no, yes := int64(1337), false, true
	p.Spec.InitContainers = []corev1.Container{{
		Name: "istio-validation", Image: meshcniImage, ImagePullPolicy: corev1.PullNever,
		Command: []string{image.PathInImage("meshcnictl"), "validate", "--probe-timeout=1s"},
		SecurityContext: &corev1.SecurityContext{RunAsUser: &uid, RunAsGroup: &uid, RunAsNonRoot: &yes, AllowPrivilegeEscalation: &no,
			ReadOnlyRootFilesystem: &yes, Capabilities: &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}}},
	}}
	return p
}

// validationExit is the last exit code of the pod's istio-validation container (-1: none).
func validationExit(p *corev1.Pod) int32 {
	for _, s := range p.Status.InitContainerStatuses {
		if s.Name != "istio-validation" {
			continue
		}
		if t := s.State.Terminated; t != nil {
			return t.ExitCode
		}
		if t := s.LastTerminationState.Terminated; t != nil {
			return t.ExitCode
		}
	}
	return -1
}

// podStream creates a meshed pod every interval until stop is called; stop returns the
// names created.
func podStream(ctx context.Context, t *testing.T, tb *testbed.Testbed, prefix string, every time.Duration) (stop func() []string) {
	t.Helper()
	var (
		mu    sync.Mutex
		names []string
		done  = make(chan struct{})
		ended = make(chan struct{})
	)
	go func() {
		defer close(ended)
		tick := time.NewTicker(every)
		defer tick.Stop()
		for i := 0; ; i++ {
			name := fmt.Sprintf("%s-%03d", prefix, i)
			if _, err := tb.CreatePod(ctx, meshedPod(name)); err != nil {
				t.Errorf("pod stream: %v", err)
				return
			}
			mu.Lock()
			names = append(names, name)
			mu.Unlock()
			select {
			case <-done:
				return
			case <-ctx.Done():
				return
			case <-tick.C:
			}
		}
	}()
	return func() []string {
		close(done)
		<-ended
		mu.Lock()
		defer mu.Unlock()
		return names
	}
}

// audit is what the node says of a stream's pods.
type audit struct {
	redirected, unredirected, notStarted []string
	drift                                []string // one line per unredirected pod
	// deleted: gone before they could be checked. The test deletes none of them:
	// meshcni's audit evicted them as escaped (started with no redirect, no
	// validation init container; audit.escapedAction evict).
	deleted []string
}

// auditPods waits up to wait for every pod to run, then checks from the node, in each
// running pod's network namespace, that meshcni's rules for its spec are all there.
func auditPods(ctx context.Context, t *testing.T, tb *testbed.Testbed, names []string, wait time.Duration) audit {
	t.Helper()
	deadline := time.Now().Add(wait)
	var a audit
	for _, name := range names {
		var pod *corev1.Pod
		for {
			p, err := tb.Client.CoreV1().Pods(streamNamespace).Get(ctx, name, metav1.GetOptions{})
			if apierrors.IsNotFound(err) {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			if p.Status.Phase == corev1.PodRunning {
				pod = p
				break
			}
			if time.Now().After(deadline) {
				break
			}
			time.Sleep(200 * time.Millisecond)
		}
		if pod == nil {
			if gone(ctx, t, tb, name) {
				a.deleted = append(a.deleted, name)
			} else {
				a.notStarted = append(a.notStarted, name)
			}
			continue
		}
		netns, err := tb.PodNetns(ctx, streamNamespace, name)
		if err != nil && gone(ctx, t, tb, name) {
			a.deleted = append(a.deleted, name)
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		s, err := capture.Spec(k8spod.From(pod))
		if err != nil {
			t.Fatal(err)
		}
		var ips []netip.Addr
		for _, ip := range pod.Status.PodIPs {
			ips = append(ips, netip.MustParseAddr(ip.IP))
		}
		capture.WithFamilies(s, ips)
		d, err := engine.Check(ctx, engine.Options{Backend: backend.Auto, NetnsPath: netns}, s)
		switch {
		case err != nil && gone(ctx, t, tb, name):
			a.deleted = append(a.deleted, name)
		case err != nil:
			t.Fatalf("check %s: %v", name, err)
		case d.Empty():
			a.redirected = append(a.redirected, name)
		default:
			a.unredirected = append(a.unredirected, name)
			a.drift = append(a.drift, fmt.Sprintf("%s: %d rules missing, %d unexpected", name, len(d.Missing), len(d.Unexpected)))
		}
	}
	return a
}

// gone reports whether the stream's pod name no longer exists.
func gone(ctx context.Context, t *testing.T, tb *testbed.Testbed, name string) bool {
	t.Helper()
	_, err := tb.Client.CoreV1().Pods(streamNamespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		t.Fatal(err)
	}
	return apierrors.IsNotFound(err)
}

// deleteStream deletes the stream's pods and waits until they are gone (their CNI DEL
// runs while meshcni is installed).
func deleteStream(ctx context.Context, t *testing.T, tb *testbed.Testbed) {
	t.Helper()
	zero := int64(0)
	if err := tb.Client.CoreV1().Pods(streamNamespace).DeleteCollection(ctx, metav1.DeleteOptions{GracePeriodSeconds: &zero}, metav1.ListOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := poll(ctx, 2*time.Minute, func() error {
		l, err := tb.Client.CoreV1().Pods(streamNamespace).List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		if len(l.Items) > 0 {
			return fmt.Errorf("%d stream pods left", len(l.Items))
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}

// agentStatus returns the value of field (e.g. "Seccomp:", "CapEff:") in
// /proc/PID/status of every meshcni-agent process on the node.
func agentStatus(t *testing.T, field string) []string {
	t.Helper()
	procs, err := filepath.Glob("/proc/[0-9]*/comm")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, p := range procs {
		comm, err := os.ReadFile(p)
		if err != nil || strings.TrimSpace(string(comm)) != "meshcni-agent" {
			continue
		}
		st, err := os.ReadFile(filepath.Join(filepath.Dir(p), "status"))
		if err != nil {
			continue
		}
		for _, l := range strings.Split(string(st), "\n") {
			if v, ok := strings.CutPrefix(l, field); ok {
				out = append(out, strings.TrimSpace(v))
			}
		}
	}
	return out
}

// agentSeccomp returns the Seccomp line of /proc/PID/status of every meshcni-agent
// process on the node (2: a filter, as RuntimeDefault installs).
func agentSeccomp(t *testing.T) []string { return agentStatus(t, "Seccomp:") }
