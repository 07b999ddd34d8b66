package istio

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/standin/proxysim"
)

// The app run under the real injector (the e2e test and `make demo ISTIO=1`): a
// client and a server Deployment of AppImage in a namespace labelled
// istio-injection=enabled.
const (
	AppPort = 8080 // the echo server's
	AppUID  = 1000
	// AppContainer and ProxyContainer are the app's container and the injected
	// sidecar's.
	AppContainer   = "app"
	ProxyContainer = "istio-proxy"
)

// App is the client and server pods once Ready.
type App struct {
	Namespace      string
	Client, Server *corev1.Pod
	// Ready is the time from creating the Deployments to both pods Ready.
	Ready time.Duration
}

// Deployment is one app Deployment: AppImage serving TCP on AppPort as AppUID (the
// client serves too, to stay up; probes are exec'd in it).
func Deployment(namespace, name string) *appsv1.Deployment {
	one := int32(1)
	uid := int64(AppUID)
	labels := map[string]string{"app": name}
	return &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace},
		Spec: appsv1.DeploymentSpec{
			Replicas: &one,
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec: corev1.PodSpec{
					TerminationGracePeriodSeconds: new(int64),
					Containers: []corev1.Container{{
						Name: AppContainer, Image: AppImage, ImagePullPolicy: corev1.PullNever,
						Args:            []string{"serve"},
						Env:             []corev1.EnvVar{{Name: "PORT", Value: strconv.Itoa(AppPort)}},
						Ports:           []corev1.ContainerPort{{ContainerPort: AppPort}},
						SecurityContext: &corev1.SecurityContext{RunAsUser: &uid, RunAsGroup: &uid},
					}},
				},
			},
		},
	}
}

// StartApp creates the namespace with istio-injection=enabled, the server and the
// client Deployment, and waits until both pods are Ready.
func StartApp(ctx context.Context, tb *testbed.Testbed, namespace string) (*App, error) {
	if err := tb.CreateNamespace(ctx, namespace); err != nil {
		return nil, err
	}
	label := []byte(`{"metadata":{"labels":{"istio-injection":"enabled"}}}`)
	if _, err := tb.Client.CoreV1().Namespaces().Patch(ctx, namespace, types.StrategicMergePatchType, label, metav1.PatchOptions{}); err != nil {
		return nil, fmt.Errorf("label namespace %s: %w", namespace, err)
	}
	app := &App{Namespace: namespace}
	created := time.Now()
	for _, name := range []string{"server", "client"} {
		if _, err := tb.Client.AppsV1().Deployments(namespace).Create(ctx, Deployment(namespace, name), metav1.CreateOptions{}); err != nil {
			return nil, fmt.Errorf("create Deployment %s: %w", name, err)
		}
	}
	var err error
	if app.Server, err = readyPod(ctx, tb, namespace, "server"); err != nil {
		return app, err
	}
	if app.Client, err = readyPod(ctx, tb, namespace, "client"); err != nil {
		return app, err
	}
	app.Ready = time.Since(created)
	return app, nil
}

// readyPod waits for the Deployment's pod and for it to be Ready.
func readyPod(ctx context.Context, tb *testbed.Testbed, namespace, app string) (*corev1.Pod, error) {
	wctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	for {
		l, err := tb.Client.CoreV1().Pods(namespace).List(wctx, metav1.ListOptions{LabelSelector: "app=" + app})
		if err == nil && len(l.Items) == 1 {
			return tb.WaitPodReady(wctx, namespace, l.Items[0].Name)
		}
		select {
		case <-wctx.Done():
			return nil, fmt.Errorf("no pod of Deployment %s: %w", app, wctx.Err())
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// Traffic is one client → server probe and what the two proxies recorded of it.
type Traffic struct {
	Dst               netip.AddrPort
	Probe             proxysim.ProbeResult
	Outbound, Inbound proxysim.Record
}

// Probe connects from the client's app container to the server's pod IP:AppPort
// (`/proxysim client`, as AppUID) and finds the connection in the client proxy's
// records (outbound, that original destination) and the server proxy's (inbound,
// from the client's pod IP, that original destination).
func (a *App) Probe(ctx context.Context, tb *testbed.Testbed) (*Traffic, error) {
	tr := &Traffic{Dst: netip.AddrPortFrom(netip.MustParseAddr(a.Server.Status.PodIP), AppPort)}
	clientIP := netip.MustParseAddr(a.Client.Status.PodIP)
	stdout, stderr, err := tb.Exec(ctx, a.Namespace, a.Client.Name, AppContainer, "/proxysim", "client", "--connect", tr.Dst.String(), "--send", "hello\n")
	if err != nil {
		return tr, fmt.Errorf("probe from %s: %w: %s", a.Client.Name, err, stderr)
	}
	if err := json.Unmarshal([]byte(stdout), &tr.Probe); err != nil {
		return tr, fmt.Errorf("probe result %q: %w", stdout, err)
	}
	tr.Outbound, err = waitRecord(ctx, tb, a.Namespace, a.Client.Name, func(r proxysim.Record) bool {
		return r.Event == proxysim.EventConn && r.Listener == proxysim.ListenerOutbound && r.OrigDst == tr.Dst
	})
	if err != nil {
		return tr, fmt.Errorf("client proxy: %w", err)
	}
	tr.Inbound, err = waitRecord(ctx, tb, a.Namespace, a.Server.Name, func(r proxysim.Record) bool {
		return r.Event == proxysim.EventConn && r.Listener == proxysim.ListenerInbound && r.OrigDst == tr.Dst && r.Peer.Addr() == clientIP
	})
	if err != nil {
		return tr, fmt.Errorf("server proxy: %w", err)
	}
	return tr, nil
}

// ProxyRecords are the stand-in's records in an istio-proxy container's log
// (pilot-agent passes Envoy's stdout through).
func ProxyRecords(logs string) []proxysim.Record {
	var out []proxysim.Record
	for _, line := range strings.Split(logs, "\n") {
		if !strings.HasPrefix(line, `{"event":`) {
			continue
		}
		var r proxysim.Record
		if json.Unmarshal([]byte(line), &r) == nil {
			out = append(out, r)
		}
	}
	return out
}

// waitRecord polls a pod's istio-proxy log for a record matching match.
func waitRecord(ctx context.Context, tb *testbed.Testbed, namespace, pod string, match func(proxysim.Record) bool) (proxysim.Record, error) {
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	var logs string
	for {
		var err error
		logs, err = tb.PodLogs(ctx, namespace, pod, ProxyContainer)
		if err == nil {
			for _, r := range ProxyRecords(logs) {
				if match(r) {
					return r, nil
				}
			}
		}
		select {
		case <-ctx.Done():
			return proxysim.Record{}, errors.New("no matching record in the istio-proxy log:\n" + logs)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// DeleteNamespace deletes the app's namespace and waits until it is gone.
func DeleteNamespace(ctx context.Context, tb *testbed.Testbed, namespace string) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	err := tb.Client.CoreV1().Namespaces().Delete(ctx, namespace, metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete namespace %s: %w", namespace, err)
	}
	for {
		if _, err := tb.Client.CoreV1().Namespaces().Get(ctx, namespace, metav1.GetOptions{}); apierrors.IsNotFound(err) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("namespace %s not gone: %w", namespace, ctx.Err())
		case <-time.After(250 * time.Millisecond):
		}
	}
}
