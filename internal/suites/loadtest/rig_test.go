package loadtest_test

// The rig of the churn tests: the test bed's primary CNI chain (bridge + host-local +
// portmap, testbed.DefaultPlugins, on a bridge and subnet of its own so it never meets
// the node's pods) in temporary CNI directories that a real meshcni-agent manages,
// driven through libcni the way a container runtime drives it, in network namespaces
// the test creates; the pods are real API objects bound to a node name of the test's
// own (the agent caches that node's pods and answers the plugin's lookups).

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/vishvananda/netlink"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/capture/k8spod"
	"github.com/meshcni/meshcni/pkg/engine"
	"github.com/meshcni/meshcni/pkg/fileutil"
)

const (
	// loadBridge and loadSubnet keep the churn away from the node's mcni0 and its pods.
	loadBridge  = "mcniload0"
	loadSubnet  = "10.216.0.0/16"
	loadGateway = "10.216.0.1"
	primaryName = "10-testbed.conflist"
	loadNS      = "meshcni-load"
)

// rig is one churn set-up.
type rig struct {
	tb                       *testbed.Testbed
	confDir, binDir, ipamDir string
	cacheDir                 string
	node                     string
	primary                  []byte // the primary CNI's own conflist (no meshcni)
	cni                      *libcni.CNIConfig
}

func newRig(t *testing.T, tb *testbed.Testbed) *rig {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	bins, err := testbed.Build(ctx, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatalf("test bed binaries: %v", err)
	}
	r := &rig{
		tb: tb, confDir: t.TempDir(), binDir: t.TempDir(), ipamDir: t.TempDir(), cacheDir: t.TempDir(),
		node: fmt.Sprintf("meshcni-load-%06x", rand.Uint32()&0xffffff),
	}
	for _, name := range []string{"bridge", "host-local", "portmap", "loopback"} {
		b, err := os.ReadFile(filepath.Join(bins.CNIPluginDir(), name))
		if err != nil {
			t.Fatalf("reference CNI plugin: %v", err)
		}
		if err := fileutil.WriteFileAtomic(filepath.Join(r.binDir, name), b, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	plugins := testbed.DefaultPlugins()
	plugins[0]["bridge"] = loadBridge
	plugins[0]["ipam"] = map[string]any{
		"type":    "host-local",
		"ranges":  [][]map[string]string{{{"subnet": loadSubnet, "gateway": loadGateway}}},
		"dataDir": r.ipamDir,
	}
	if r.primary, err = testbed.Conflist(plugins); err != nil {
		t.Fatal(err)
	}
	if err := fileutil.WriteFileAtomic(filepath.Join(r.confDir, primaryName), r.primary, 0o644); err != nil {
		t.Fatal(err)
	}
	r.cni = libcni.NewCNIConfigWithCacheDir([]string{r.binDir}, r.cacheDir, nil)
	t.Cleanup(func() {
		if l, err := netlink.LinkByName(loadBridge); err == nil {
			_ = netlink.LinkDel(l)
		}
	})
	if err := ensureNamespace(ctx, tb, loadNS); err != nil {
		t.Fatal(err)
	}
	return r
}

func ensureNamespace(ctx context.Context, tb *testbed.Testbed, name string) error {
	err := tb.CreateNamespace(ctx, name)
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	return nil
}

// loadList loads the CNI configuration the way containerd does (max_conf_num 1):
// the lexically first .conf/.conflist/.json of the directory, as a list (the
// agent converts a single .conf to a .conflist).
func (r *rig) loadList() (*libcni.NetworkConfigList, []byte, error) {
	files, err := libcni.ConfFiles(r.confDir, []string{".conf", ".conflist", ".json"})
	if err != nil {
		return nil, nil, err
	}
	if len(files) == 0 {
		return nil, nil, errors.New("no CNI configuration")
	}
	slices.Sort(files)
	data, err := os.ReadFile(files[0])
	if err != nil {
		return nil, nil, err
	}
	l, err := libcni.NetworkConfFromBytes(data)
	if err != nil {
		return nil, data, fmt.Errorf("%s: %w", files[0], err)
	}
	return l, data, nil
}

func hasMeshcni(l *libcni.NetworkConfigList) bool {
	return slices.ContainsFunc(l.Plugins, func(p *libcni.PluginConfig) bool { return p.Network.Type == "meshcni" })
}

// meshedPod is what Istio's injector stores (with istio-cni: no istio-init), bound to
// the rig's node.
func (r *rig) meshedPod(name string) *corev1.Pod {
	no := false
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: loadNS, Name: name, Labels: map[string]string{"app": "load"},
			Annotations: map[string]string{capture.AnnotationStatus: `{"containers":["istio-proxy"],"initContainers":["istio-validation"]}`}},
		Spec: corev1.PodSpec{
			NodeName:                     r.node,
			AutomountServiceAccountToken: &no,
			Containers: []corev1.Container{
				{Name: "app", Image: "registry.example/app:1"},
				{Name: capture.ProxyContainer, Image: "docker.io/istio/proxyv2:1.27.0", Args: []string{"proxy", "sidecar"}},
			},
		},
	}
}

// podFeed creates pods ahead of the cycles (so the agent's cache holds them when
// their ADD comes, as when kubelet runs a pod bound a moment earlier) and deletes
// them after their cycle; both retry while the API server is away.
type podFeed struct {
	r       *rig
	ch      chan *corev1.Pod
	del     chan string
	wg      sync.WaitGroup
	retries atomic.Int64
}

func (r *rig) feed(ctx context.Context, total, ahead int) *podFeed {
	f := &podFeed{r: r, ch: make(chan *corev1.Pod, ahead), del: make(chan string, 4096)}
	prefix := fmt.Sprintf("load-%04x", rand.Uint32()&0xffff)
	f.wg.Add(2)
	go func() {
		defer f.wg.Done()
		defer close(f.ch)
		for i := 0; i < total; i++ {
			p := r.meshedPod(fmt.Sprintf("%s-%d", prefix, i))
			for {
				c, err := r.tb.Client.CoreV1().Pods(loadNS).Create(ctx, p, metav1.CreateOptions{})
				if err == nil {
					p = c
					break
				}
				if ctx.Err() != nil {
					return
				}
				f.retries.Add(1)
				time.Sleep(100 * time.Millisecond)
			}
			select {
			case f.ch <- p:
			case <-ctx.Done():
				return
			}
		}
	}()
	go func() {
		defer f.wg.Done()
		zero := int64(0)
		for name := range f.del {
			for {
				err := r.tb.Client.CoreV1().Pods(loadNS).Delete(context.WithoutCancel(ctx), name, metav1.DeleteOptions{GracePeriodSeconds: &zero})
				if err == nil || apierrors.IsNotFound(err) {
					break
				}
				f.retries.Add(1)
				time.Sleep(100 * time.Millisecond)
			}
		}
	}()
	return f
}

// done ends the deleter once every cycle has handed back its pod.
func (f *podFeed) done() {
	close(f.del)
	f.wg.Wait()
}

// outcome is what one ADD/DEL cycle found.
type outcome struct {
	listHadMeshcni bool
	addErr, delErr error
	// started: ADD returned success; redirected: meshcni's rules were in the netns
	// with no drift; leftRules: rules still there after DEL.
	started, redirected bool
	drift               string
	leftRules           string
	add, del            time.Duration
}

var netnsSeq atomic.Uint64

// cycle runs one pod's ADD and DEL through the chain in a fresh network namespace and
// audits it: after a successful ADD the pod must be redirected (meshcni's rules, no
// drift, as `meshcnictl inspect` reads them); after DEL no rule of meshcni's remains.
func (r *rig) cycle(ctx context.Context, pod *corev1.Pod) outcome {
	var o outcome
	nsPath, err := testutil.CreateNetns(fmt.Sprintf("mcni-load-%d-%d", os.Getpid(), netnsSeq.Add(1)))
	if err != nil {
		o.addErr = fmt.Errorf("create netns: %w", err)
		return o
	}
	defer func() {
		if err := testutil.DeleteNetns(nsPath); err != nil && o.delErr == nil {
			o.delErr = fmt.Errorf("delete netns: %w", err)
		}
	}()
	list, data, err := r.loadList()
	if err != nil {
		o.addErr = fmt.Errorf("load CNI configuration: %w\n%s", err, data)
		return o
	}
	o.listHadMeshcni = hasMeshcni(list)
	rt := &libcni.RuntimeConf{
		ContainerID: fmt.Sprintf("load%016x", rand.Uint64()),
		NetNS:       nsPath,
		IfName:      "eth0",
		Args: [][2]string{
			{"IgnoreUnknown", "1"},
			{"K8S_POD_NAMESPACE", pod.Namespace},
			{"K8S_POD_NAME", pod.Name},
			{"K8S_POD_INFRA_CONTAINER_ID", "infra"},
			{"K8S_POD_UID", string(pod.UID)},
		},
	}
	began := time.Now()
	res, err := r.cni.AddNetworkList(ctx, list, rt)
	o.add = time.Since(began)
	o.addErr = err
	if err == nil {
		o.started = true
		o.redirected, o.drift = audit(ctx, pod, res, nsPath)
	}
	// The runtime calls DEL after a failed ADD too.
	began = time.Now()
	o.delErr = r.cni.DelNetworkList(ctx, list, rt)
	o.del = time.Since(began)
	if l, err := engine.Live(ctx, engine.Options{Backend: backend.Auto, NetnsPath: nsPath}); err != nil {
		o.leftRules = "live rules: " + err.Error()
	} else {
		for k, v := range l {
			if strings.TrimSpace(v) != "" {
				o.leftRules += fmt.Sprintf("%s:\n%s\n", k, v)
			}
		}
	}
	return o
}

// audit reports whether the netns holds the pod's redirect with no drift.
func audit(ctx context.Context, pod *corev1.Pod, res types.Result, nsPath string) (bool, string) {
	s, err := capture.Spec(k8spod.From(pod))
	if err != nil {
		return false, "spec: " + err.Error()
	}
	cr, err := current.NewResultFromResult(res)
	if err != nil {
		return false, "ADD result: " + err.Error()
	}
	var ips []netip.Addr
	for _, ip := range cr.IPs {
		if a, ok := netip.AddrFromSlice(ip.Address.IP); ok {
			ips = append(ips, a.Unmap())
		}
	}
	capture.WithFamilies(s, ips)
	d, err := engine.Check(ctx, engine.Options{Backend: backend.Auto, NetnsPath: nsPath}, s)
	if err != nil {
		return false, "check: " + err.Error()
	}
	if !d.Empty() {
		return false, d.String()
	}
	return true, ""
}
