package agent_test

// The agent's memory with a cluster's worth of pods: the node-scoped informer
// (pkg/agent/nodepods) must make the agent's RSS follow its node's pods, not the cluster's.
//
//	go test ./pkg/agent -run '^$' -bench AgentRSS -benchtime 3x   # root, test bed built
//
// An API-only test bed holds 92 fake nodes' worth of Pod objects (110 per node, 10 120)
// plus a dense node with 1 000, 11 120 in all (no kubelet runs them); the real
// meshcni-agent binary runs b.N times per scenario and its VmRSS is read from /proc
// once its pod cache has synced (it answers the plugin's pod lookup over its socket)
// and its RSS has settled. The table printed at the end is docs/agent.md's.

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/testkit/agenttest"
	"github.com/meshcni/meshcni/pkg/agentsock"
	"github.com/meshcni/meshcni/pkg/capture"
)

const (
	rssNS        = "bench-rss"
	rssNodes     = 91  // other nodes
	rssPerNode   = 110 // kubelet's default max pods
	rssAgentNode = "rss-node-agent"
	rssEmptyNode = "rss-node-empty"
	rssDenseNode = "rss-node-dense" // a node with rssDensePods pods, for the slope
	rssDensePods = 1000
	rssWorkers   = 32
)

// rssPodName names the i-th pod of a node.
func rssPodName(node string, i int) string { return fmt.Sprintf("%s-app-%03d", node, i) }

// rssPod is a typical Istio-injected pod as the API server stores it (≈ 4 KiB of
// JSON): labels, the sidecar status annotation, an app and an istio-proxy container
// with their env, ports, probes and mounts, and Istio's volumes. Bound to node.
func rssPod(node string, i int) *corev1.Pod {
	name := rssPodName(node, i)
	app := fmt.Sprintf("svc-%02d", i%37)
	cpu, mem := resource.MustParse("100m"), resource.MustParse("128Mi")
	proxyEnv := []corev1.EnvVar{
		{Name: "PILOT_CERT_PROVIDER", Value: "istiod"},
		{Name: "CA_ADDR", Value: "istiod.istio-system.svc:15012"},
		{Name: "POD_NAME", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "metadata.name"}}},
		{Name: "POD_NAMESPACE", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "metadata.namespace"}}},
		{Name: "INSTANCE_IP", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "status.podIP"}}},
		{Name: "SERVICE_ACCOUNT", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "spec.serviceAccountName"}}},
		{Name: "HOST_IP", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "status.hostIP"}}},
		{Name: "ISTIO_CPU_LIMIT", ValueFrom: &corev1.EnvVarSource{ResourceFieldRef: &corev1.ResourceFieldSelector{Resource: "limits.cpu"}}},
		{Name: "PROXY_CONFIG", Value: "{}\n"},
		{Name: "ISTIO_META_POD_PORTS", Value: `[{"name":"http","containerPort":8080,"protocol":"TCP"}]`},
		{Name: "ISTIO_META_APP_CONTAINERS", Value: "app"},
		{Name: "ISTIO_META_CLUSTER_ID", Value: "Kubernetes"},
		{Name: "ISTIO_META_NODE_NAME", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "spec.nodeName"}}},
		{Name: "ISTIO_META_INTERCEPTION_MODE", Value: "REDIRECT"},
		{Name: "ISTIO_META_WORKLOAD_NAME", Value: app},
		{Name: "ISTIO_META_OWNER", Value: "kubernetes://apis/apps/v1/namespaces/" + rssNS + "/deployments/" + app},
		{Name: "ISTIO_META_MESH_ID", Value: "cluster.local"},
		{Name: "TRUST_DOMAIN", Value: "cluster.local"},
	}
	mounts := []corev1.VolumeMount{
		{Name: "workload-socket", MountPath: "/var/run/secrets/workload-spiffe-uds"},
		{Name: "credential-socket", MountPath: "/var/run/secrets/credential-uds"},
		{Name: "workload-certs", MountPath: "/var/run/secrets/workload-spiffe-credentials"},
		{Name: "istiod-ca-cert", MountPath: "/var/run/secrets/istio"},
		{Name: "istio-data", MountPath: "/var/lib/istio/data"},
		{Name: "istio-envoy", MountPath: "/etc/istio/proxy"},
		{Name: "istio-token", MountPath: "/var/run/secrets/tokens"},
		{Name: "istio-podinfo", MountPath: "/etc/istio/pod"},
	}
	var volumes []corev1.Volume
	for _, n := range []string{"workload-socket", "credential-socket", "workload-certs", "istio-envoy", "istio-data"} {
		volumes = append(volumes, corev1.Volume{Name: n, VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}})
	}
	exp := int64(43200)
	volumes = append(volumes,
		corev1.Volume{Name: "istio-podinfo", VolumeSource: corev1.VolumeSource{DownwardAPI: &corev1.DownwardAPIVolumeSource{Items: []corev1.DownwardAPIVolumeFile{
			{Path: "labels", FieldRef: &corev1.ObjectFieldSelector{FieldPath: "metadata.labels"}},
			{Path: "annotations", FieldRef: &corev1.ObjectFieldSelector{FieldPath: "metadata.annotations"}},
		}}}},
		corev1.Volume{Name: "istio-token", VolumeSource: corev1.VolumeSource{Projected: &corev1.ProjectedVolumeSource{Sources: []corev1.VolumeProjection{
			{ServiceAccountToken: &corev1.ServiceAccountTokenProjection{Audience: "istio-ca", ExpirationSeconds: &exp, Path: "istio-token"}},
		}}}},
		corev1.Volume{Name: "istiod-ca-cert", VolumeSource: corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{
			LocalObjectReference: corev1.LocalObjectReference{Name: "istio-ca-root-cert"}}}},
	)
	probe := func(port int, path string) *corev1.Probe {
		return &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: path, Port: intstr.FromInt32(int32(port))}},
			PeriodSeconds: 2, FailureThreshold: 30}
	}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name: name, Namespace: rssNS,
			Labels: map[string]string{
				"app": app, "version": "v1", "pod-template-hash": "7d9f8b6c5d",
				"security.istio.io/tlsMode": "istio", "service.istio.io/canonical-name": app,
				"service.istio.io/canonical-revision": "v1",
			},
			Annotations: map[string]string{
				capture.AnnotationStatus:                       `{"initContainers":null,"containers":["istio-proxy"],"volumes":["workload-socket","credential-socket","workload-certs","istio-envoy","istio-data","istio-podinfo","istio-token","istiod-ca-cert"],"imagePullSecrets":null,"revision":"default"}`,
				"kubectl.kubernetes.io/default-container":      "app",
				"kubectl.kubernetes.io/default-logs-container": "app",
				"prometheus.io/path":                           "/stats/prometheus",
				"prometheus.io/port":                           "15020",
				"prometheus.io/scrape":                         "true",
				"istio.io/rev":                                 "default",
			},
		},
		Spec: corev1.PodSpec{
			NodeName: node,
			Containers: []corev1.Container{
				{
					Name: "app", Image: "registry.example/" + app + ":1.0", ImagePullPolicy: corev1.PullIfNotPresent,
					Ports:     []corev1.ContainerPort{{Name: "http", ContainerPort: 8080, Protocol: corev1.ProtocolTCP}},
					Env:       []corev1.EnvVar{{Name: "LOG_LEVEL", Value: "info"}, {Name: "PORT", Value: "8080"}},
					Resources: corev1.ResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceCPU: cpu, corev1.ResourceMemory: mem}},
					ReadinessProbe: &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{
						Path: "/app-health/app/readyz", Port: intstr.FromInt32(15020)}}, PeriodSeconds: 10},
				},
				{
					Name: capture.ProxyContainer, Image: "docker.io/istio/proxyv2:1.24.0", ImagePullPolicy: corev1.PullIfNotPresent,
					Args: []string{"proxy", "sidecar", "--domain", rssNS + ".svc.cluster.local", "--proxyLogLevel=warning",
						"--proxyComponentLogLevel=misc:error", "--log_output_level=default:info"},
					Ports: []corev1.ContainerPort{
						{Name: "http-envoy-prom", ContainerPort: 15090, Protocol: corev1.ProtocolTCP},
					},
					Env:            proxyEnv,
					Resources:      corev1.ResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceCPU: cpu, corev1.ResourceMemory: mem}},
					ReadinessProbe: probe(15021, "/healthz/ready"),
					StartupProbe:   probe(15021, "/healthz/ready"),
					VolumeMounts:   mounts,
				},
			},
			Volumes: volumes,
		},
	}
}

// rssClient is an admin client without client-side rate limits, for bulk creation.
func rssClient(tb *testbed.Testbed) (kubernetes.Interface, error) {
	c := rest.CopyConfig(tb.RESTConfig)
	c.QPS, c.Burst = 5000, 10000
	c.ContentType = "application/vnd.kubernetes.protobuf"
	return kubernetes.NewForConfig(c)
}

// ensureRSSPods creates the benchmark's pods that do not exist yet, with rssWorkers
// concurrent clients; it returns how many it created and how long that took.
func ensureRSSPods(ctx context.Context, cs kubernetes.Interface) (total, created int, took time.Duration, err error) {
	if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: rssNS}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return 0, 0, 0, err
	}
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: rssNS, Name: "default"}}
	if _, err := cs.CoreV1().ServiceAccounts(rssNS).Create(ctx, sa, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return 0, 0, 0, err
	}
	have := map[string]bool{}
	opts := metav1.ListOptions{Limit: 1000}
	for {
		l, err := cs.CoreV1().Pods(rssNS).List(ctx, opts)
		if err != nil {
			return 0, 0, 0, err
		}
		for _, p := range l.Items {
			have[p.Name] = true
		}
		if opts.Continue = l.Continue; opts.Continue == "" {
			break
		}
	}
	nodes := []string{rssAgentNode}
	for n := range rssNodes {
		nodes = append(nodes, fmt.Sprintf("rss-node-%02d", n))
	}
	todo := make(chan *corev1.Pod)
	var n atomic.Int64
	var firstErr error
	var mu sync.Mutex
	began := time.Now()
	var wg sync.WaitGroup
	for range rssWorkers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for p := range todo {
				_, err := cs.CoreV1().Pods(rssNS).Create(ctx, p, metav1.CreateOptions{})
				switch {
				case err == nil:
					n.Add(1)
				case apierrors.IsAlreadyExists(err):
				default:
					mu.Lock()
					if firstErr == nil {
						firstErr = fmt.Errorf("create pod %s: %w", p.Name, err)
					}
					mu.Unlock()
				}
			}
		}()
	}
	for _, node := range nodes {
		for i := range rssPerNode {
			total++
			if !have[rssPodName(node, i)] {
				todo <- rssPod(node, i)
			}
		}
	}
	for i := range rssDensePods {
		total++
		if !have[rssPodName(rssDenseNode, i)] {
			todo <- rssPod(rssDenseNode, i)
		}
	}
	close(todo)
	wg.Wait()
	return total, int(n.Load()), time.Since(began), firstErr
}

// lookup asks the agent, over its socket as the plugin does, for a pod of its cache.
// lookup asks the agent for a pod as the plugin does: with its UID (kubelet's
// K8S_POD_UID), which cs reads from the API; the agent answers a lookup without one
// with a miss.
func lookup(ctx context.Context, cs kubernetes.Interface, a *agenttest.Agent, name string) (agentsock.PodResponse, error) {
	var resp agentsock.PodResponse
	pod, err := cs.CoreV1().Pods(rssNS).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return resp, err
	}
	c, err := agentsock.Dial(a.RunDir)
	if err != nil {
		return resp, err
	}
	defer c.Close()
	cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	err = c.Call(cctx, agentsock.RequestPod, agentsock.PodRequest{Namespace: rssNS, Name: name, UID: string(pod.UID)}, &resp)
	return resp, err
}

// rssSample is one run of the agent.
type rssSample struct {
	rss, heap float64 // bytes
	settle    time.Duration
}

// measureAgent starts the agent, waits until it is ready and its pod cache has synced
// (it answers the plugin's pod lookup: a pod of its node found, a pod of another node
// a miss), then until its RSS has settled (5 samples 200 ms apart within 1 %, at most
// 15 s); it reads VmRSS and the Go heap in use, and stops the agent. cached is the
// pod of its node the cache must hold ("" when it has none); without API access the
// lookup must say there is no cache.
func measureAgent(b *testing.B, cs kubernetes.Interface, o agenttest.Options, cached string) rssSample {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	began := time.Now()
	a := agenttest.Start(b, o)
	other := rssPodName("rss-node-00", 0)
	for {
		r, err := lookup(ctx, cs, a, other)
		if err == nil && !strings.Contains(r.Reason, "not synced") {
			if r.Found {
				b.Fatalf("the agent of node %s has pod %s of another node in its cache", o.NodeName, other)
			}
			if o.NoKubeconfig && !strings.Contains(r.Reason, "no pod cache") {
				b.Fatalf("agent without API access: %q", r.Reason)
			}
			break
		}
		if ctx.Err() != nil {
			b.Fatalf("the agent's pod cache did not sync: %v %+v\n%s", err, r, a.Log())
		}
		time.Sleep(20 * time.Millisecond)
	}
	if cached != "" {
		if r, err := lookup(ctx, cs, a, cached); err != nil || !r.Found {
			b.Fatalf("synced agent does not have its node's pod %s: %v %+v", cached, err, r)
		}
	}
	var last []int64
	deadline := time.Now().Add(15 * time.Second)
	for {
		r, err := a.RSS()
		if err != nil {
			b.Fatal(err)
		}
		last = append(last, r)
		if len(last) > 5 {
			last = last[1:]
		}
		if len(last) == 5 && float64(slices.Max(last)-slices.Min(last)) <= 0.01*float64(slices.Max(last)) || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	settle := time.Since(began)
	rss, err := a.RSS()
	if err != nil {
		b.Fatal(err)
	}
	fams := a.Metrics(b)
	heap, _ := agenttest.Value(fams, "go_memstats_heap_inuse_bytes", nil)
	if err := a.Stop(); err != nil {
		b.Fatal(err)
	}
	return rssSample{rss: float64(rss), heap: heap, settle: settle}
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	sort.Float64s(s)
	return s[len(s)/2]
}

func BenchmarkAgentRSS(b *testing.B) {
	tb := testbed.API(b)
	if tb.Mode != testbed.ModeAPIOnly {
		// A full node's controller-manager garbage-collects pods bound to
		// nodes that do not exist.
		b.Skipf("needs an API-only test bed (this one is %s): run the benchmark alone, without hack/testbed up", tb.Mode)
	}
	cs, err := rssClient(tb)
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	total, created, took, err := ensureRSSPods(ctx, cs)
	if err != nil {
		b.Fatal(err)
	}
	// Printed, not logged: a parent benchmark's log is not shown.
	fmt.Printf("BenchmarkAgentRSS: %d pods in the cluster (%d on each of %d nodes, %d on the dense node); created %d in %v with %d workers (%.0f pods/s)\n",
		total, rssPerNode, rssNodes+1, rssDensePods, created, took.Round(time.Millisecond), rssWorkers, float64(created)/took.Seconds())

	dir := b.TempDir()
	type scenario struct {
		name   string
		opts   agenttest.Options
		cached string // a pod its cache must hold
	}
	scenarios := []scenario{
		{"no-api", agenttest.Options{NoKubeconfig: true, NodeName: rssAgentNode}, ""},
		{"api-0-pods", agenttest.Options{NodeName: rssEmptyNode}, ""},
		{"api-110-pods", agenttest.Options{NodeName: rssAgentNode}, rssPodName(rssAgentNode, rssPerNode-1)},
		{"api-110-pods-audit-off", agenttest.Options{NodeName: rssAgentNode, Args: []string{"--audit-period=0"}}, rssPodName(rssAgentNode, rssPerNode-1)},
		{"api-1000-pods", agenttest.Options{NodeName: rssDenseNode}, rssPodName(rssDenseNode, rssDensePods-1)},
	}
	results := map[string][]rssSample{}
	for i, sc := range scenarios {
		b.Run(sc.name, func(b *testing.B) {
			var rss, heap []float64
			results[sc.name] = nil // keep the last round's runs only
			for range b.N {
				o := sc.opts
				o.ConfDir, o.BinDir = filepath.Join(dir, fmt.Sprint(i), "net.d"), filepath.Join(dir, fmt.Sprint(i), "bin")
				prepareDirs(b, o.ConfDir, o.BinDir)
				s := measureAgent(b, cs, o, sc.cached)
				results[sc.name] = append(results[sc.name], s)
				rss, heap = append(rss, s.rss), append(heap, s.heap)
			}
			b.ReportMetric(median(rss)/(1<<20), "MiB-RSS")
			b.ReportMetric(median(heap)/(1<<20), "MiB-heap")
		})
	}
	var rows []string
	base := 0.0
	for _, sc := range scenarios {
		ss := results[sc.name]
		if len(ss) == 0 {
			continue
		}
		var rss, heap, settle []float64
		var runs []string
		for _, s := range ss {
			rss, heap, settle = append(rss, s.rss), append(heap, s.heap), append(settle, s.settle.Seconds())
			runs = append(runs, fmt.Sprintf("%.1f", s.rss/(1<<20)))
		}
		m := median(rss)
		if sc.name == "no-api" {
			base = m
		}
		ratio := "—"
		if base > 0 {
			ratio = fmt.Sprintf("%.2f", m/base)
		}
		rows = append(rows, fmt.Sprintf("| %s | %.1f MiB (%s) | %.1f MiB | %s | %.1f s |", sc.name, m/(1<<20), strings.Join(runs, ", "), median(heap)/(1<<20), ratio, median(settle)))
	}
	fmt.Printf("\n| agent | VmRSS median (runs) | Go heap in use | RSS / no-api | start → measured |\n|---|---|---|---|---|\n%s\n\n", strings.Join(rows, "\n"))
}

// prepareDirs makes a CNI configuration directory with a primary list, and a plugin
// directory, for an agent that must not touch the test bed's.
func prepareDirs(b *testing.B, conf, bin string) {
	b.Helper()
	for _, d := range []string{conf, bin} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			b.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(conf, "10-bench.conflist"), []byte(`{"cniVersion":"1.0.0","name":"bench","plugins":[{"type":"bridge","bridge":"cni0"}]}`+"\n"), 0o644); err != nil {
		b.Fatal(err)
	}
}
