package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/meshcni/meshcni/internal/env/istio"
	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/standin/proxysim"
)

// injectedNamespace creates a namespace labelled istio-injection=enabled, deleted
// when the test ends.
func injectedNamespace(ctx context.Context, t *testing.T, tb *testbed.Testbed, ns string) {
	t.Helper()
	if err := tb.CreateNamespace(ctx, ns); err != nil {
		t.Fatal(err)
	}
	useNamespace(t, tb, ns)
	label := []byte(`{"metadata":{"labels":{"istio-injection":"enabled"}}}`)
	if _, err := tb.Client.CoreV1().Namespaces().Patch(ctx, ns, types.StrategicMergePatchType, label, metav1.PatchOptions{}); err != nil {
		t.Fatalf("label namespace %s: %v", ns, err)
	}
}

// appDeployment is istio.Deployment with pod annotations and, for each extra port,
// a second echo container serving it.
func appDeployment(ns, name string, ann map[string]string, extraPorts ...int) *appsv1.Deployment {
	d := istio.Deployment(ns, name)
	d.TypeMeta = metav1.TypeMeta{APIVersion: "apps/v1", Kind: "Deployment"}
	d.Spec.Template.Annotations = ann
	for _, port := range extraPorts {
		c := *d.Spec.Template.Spec.Containers[0].DeepCopy()
		c.Name = fmt.Sprintf("%s-%d", istio.AppContainer, port)
		c.Env = []corev1.EnvVar{{Name: "PORT", Value: strconv.Itoa(port)}}
		c.Ports = []corev1.ContainerPort{{ContainerPort: int32(port)}}
		d.Spec.Template.Spec.Containers = append(d.Spec.Template.Spec.Containers, c)
	}
	return d
}

// createDeployments creates the Deployments and returns their pods once all are
// Ready, by Deployment name, and the time from the first create to the last Ready.
func createDeployments(ctx context.Context, t *testing.T, tb *testbed.Testbed, ds ...*appsv1.Deployment) (map[string]*corev1.Pod, time.Duration) {
	t.Helper()
	began := time.Now()
	for _, d := range ds {
		if _, err := tb.Client.AppsV1().Deployments(d.Namespace).Create(ctx, d, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create Deployment %s/%s: %v", d.Namespace, d.Name, err)
		}
	}
	pods := map[string]*corev1.Pod{}
	for _, d := range ds {
		pods[d.Name] = readyPod(ctx, t, tb, d.Namespace, d.Name)
	}
	return pods, time.Since(began)
}

// deploymentPod waits for the one pod of a Deployment (label app=name) to exist.
func deploymentPod(ctx context.Context, t *testing.T, tb *testbed.Testbed, ns, name string) *corev1.Pod {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for {
		l, err := tb.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: "app=" + name})
		if err == nil && len(l.Items) == 1 {
			return &l.Items[0]
		}
		select {
		case <-ctx.Done():
			t.Fatalf("no pod of Deployment %s/%s: %v", ns, name, ctx.Err())
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// readyPod waits until the one pod of a Deployment is Ready.
func readyPod(ctx context.Context, t *testing.T, tb *testbed.Testbed, ns, name string) *corev1.Pod {
	t.Helper()
	p := deploymentPod(ctx, t, tb, ns, name)
	wctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	p, err := tb.WaitPodReady(wctx, ns, p.Name)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func podAddr(p *corev1.Pod, port int) netip.AddrPort {
	return netip.AddrPortFrom(netip.MustParseAddr(p.Status.PodIP), uint16(port))
}

// probe runs `/proxysim client` in from's app container (as istio.AppUID) to dst.
func probe(ctx context.Context, t *testing.T, tb *testbed.Testbed, from *corev1.Pod, dst netip.AddrPort) proxysim.ProbeResult {
	t.Helper()
	stdout, stderr, err := tb.Exec(ctx, from.Namespace, from.Name, istio.AppContainer, "/proxysim", "client", "--connect", dst.String(), "--send", "hello\n")
	if err != nil {
		t.Fatalf("probe from %s to %v: %v: %s", from.Name, dst, err, stderr)
	}
	var res proxysim.ProbeResult
	if err := json.Unmarshal([]byte(stdout), &res); err != nil {
		t.Fatalf("probe result %q: %v", stdout, err)
	}
	t.Logf("probe %s → %v: %+v", from.Name, dst, res)
	return res
}

// dnsQuery runs `/proxysim dns-client` (UDP, A) in from's app container.
func dnsQuery(ctx context.Context, t *testing.T, tb *testbed.Testbed, from *corev1.Pod, server netip.AddrPort, name string) proxysim.DNSResult {
	t.Helper()
	stdout, stderr, err := tb.Exec(ctx, from.Namespace, from.Name, istio.AppContainer, "/proxysim", "dns-client", "--server", server.String(), "--name", name, "--timeout", "2s")
	if err != nil {
		t.Fatalf("dns query from %s to %v: %v: %s", from.Name, server, err, stderr)
	}
	var res proxysim.DNSResult
	if err := json.Unmarshal([]byte(stdout), &res); err != nil {
		t.Fatalf("dns result %q: %v", stdout, err)
	}
	t.Logf("dns %s → %v %s: %+v", from.Name, server, name, res)
	return res
}

// replySource is the peer address the echo server saw, the first line of its reply
// ("<hostname> <peer>").
func replySource(reply string) netip.AddrPort {
	line, _, _ := strings.Cut(reply, "\n")
	f := strings.Fields(line)
	if len(f) < 2 {
		return netip.AddrPort{}
	}
	ap, _ := netip.ParseAddrPort(f[1])
	return ap
}

// conn matches a capture record of listener with that original destination.
func conn(listener string, dst netip.AddrPort) func(proxysim.Record) bool {
	return func(r proxysim.Record) bool {
		return r.Event == proxysim.EventConn && r.Listener == listener && r.OrigDst == dst
	}
}

// waitRecord polls a pod's istio-proxy log for a record matching match and returns
// it with all the records logged so far.
func waitRecord(ctx context.Context, t *testing.T, tb *testbed.Testbed, p *corev1.Pod, what string, match func(proxysim.Record) bool) (proxysim.Record, []proxysim.Record) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	var logs string
	for {
		var err error
		if logs, err = tb.PodLogs(ctx, p.Namespace, p.Name, istio.ProxyContainer); err == nil {
			recs := istio.ProxyRecords(logs)
			for _, r := range recs {
				if match(r) {
					return r, recs
				}
			}
		}
		select {
		case <-ctx.Done():
			t.Fatalf("%s: %s: no such record in the istio-proxy log:\n%s", p.Name, what, logs)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// none asserts that no record matches.
func none(t *testing.T, p *corev1.Pod, recs []proxysim.Record, what string, match func(proxysim.Record) bool) {
	t.Helper()
	for _, r := range recs {
		if match(r) {
			t.Errorf("%s: %s, yet its proxy recorded %+v", p.Name, what, r)
		}
	}
}

// initExit is the exit code of the pod's terminated init container name (-1 when
// it has none).
func initExit(p *corev1.Pod, name string) int32 {
	for _, s := range p.Status.InitContainerStatuses {
		if s.Name != name {
			continue
		}
		if s.State.Terminated != nil {
			return s.State.Terminated.ExitCode
		}
		if s.LastTerminationState.Terminated != nil {
			return s.LastTerminationState.Terminated.ExitCode
		}
	}
	return -1
}
