package istio

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/yaml"

	"github.com/meshcni/meshcni/internal/env/demo"
	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/tools/build/ociimage"
)

// Istio's own CNI, the thing an operator migrates from: the istio-cni plugin and
// its install-cni DaemonSet, built from the pinned module and installed with Istio's
// istio-cni chart (Charts["istio-cni"]).
const (
	// CNIRelease is the Helm release of Istio's istio-cni chart, in Namespace.
	CNIRelease = "istio-cni"
	// CNIDaemonSet is the DaemonSet the chart renders (name "istio-cni" + "-node").
	CNIDaemonSet = "istio-cni-node"
	// CNIPluginType is the plugin's "type" in the conflist and its binary's name.
	CNIPluginType = "istio-cni"
	// CNIMonitoringPort is install-cni's metrics port on the test bed: it runs on the
	// host network there, where istiod already holds Istio's 15014.
	CNIMonitoringPort = 15054
)

// InstallCNIImage is the image the istio-cni chart runs: <hub>/install-cni:<tag>.
var InstallCNIImage = Hub + "/install-cni:" + Tag

// Paths inside the install-cni image, as Istio's cni/deployments/kubernetes/
// Dockerfile.install-cni lays them out (install-cni copies /opt/cni/bin to the node).
const (
	CNIPluginPath  = "/opt/cni/bin/" + CNIPluginType
	InstallCNIPath = "/usr/local/bin/install-cni"
)

// installCNIImage is the install-cni image: Istio's plugin and installer, and the
// host's iptables (the repair controller rewrites a broken pod's rules from it).
func installCNIImage(b Build, ipt map[string]string) ociimage.Options {
	files := map[string]string{CNIPluginPath: b.Bin("istio-cni"), InstallCNIPath: b.Bin("install-cni")}
	maps.Copy(files, ipt)
	return ociimage.Options{
		Ref:        InstallCNIImage,
		Files:      files,
		Dirs:       map[string]os.FileMode{"/tmp": os.ModeSticky | 0o777, "/run": 0o755},
		Env:        []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/opt/cni/bin"},
		WorkingDir: "/opt/cni/bin",
		Cmd:        []string{InstallCNIPath},
	}
}

// CNIValues are the istio-cni chart's values for the test bed: the image built here
// (never pulled), the test bed's CNI directories, small requests, and the API
// server's address for install-cni and the kubeconfig it writes for the plugin
// (KUBERNETES_SERVICE_HOST/PORT: the plugin runs on the node, where there is no
// kube-proxy), with its metrics off Istio's 15014.
func CNIValues() map[string]any {
	return map[string]any{
		"hub": Hub, "tag": Tag, "pullPolicy": "Never",
		"cniBinDir":  testbed.CNIBinDir,
		"cniConfDir": testbed.CNIConfDir,
		"resources":  map[string]any{"requests": map[string]any{"cpu": "10m", "memory": "32Mi"}},
		"env": map[string]any{
			"KUBERNETES_SERVICE_HOST": testbed.APIServerHost,
			"KUBERNETES_SERVICE_PORT": strconv.Itoa(testbed.APIServerPort),
			"MONITORING_PORT":         strconv.Itoa(CNIMonitoringPort),
		},
	}
}

// WriteCNIValues writes CNIValues as a values file and returns its path; remove it
// when done.
func WriteCNIValues() (string, error) {
	vals, err := yaml.Marshal(CNIValues())
	if err != nil {
		return "", err
	}
	f, err := os.CreateTemp("", "meshcni-istio-cni-values-*.yaml")
	if err != nil {
		return "", err
	}
	if _, err := f.Write(vals); err != nil {
		f.Close()
		os.Remove(f.Name())
		return "", err
	}
	return f.Name(), f.Close()
}

// InstallIstioCNI installs Istio's istio-cni chart (the images must be imported:
// Up does it) with CNIValues unless its release is already installed, moves its
// DaemonSet onto the host network (as the test bed needs: pods cannot reach the API
// server) and waits until install-cni is ready and its plugin is in the node's
// conflist.
func InstallIstioCNI(ctx context.Context, tb *testbed.Testbed, o Options) error {
	o.defaults()
	vf, err := WriteCNIValues()
	if err != nil {
		return err
	}
	defer os.Remove(vf)
	b, err := Lookup(ctx)
	if err != nil {
		return err
	}
	r, err := newRunner(ctx, tb, o)
	if err != nil {
		return err
	}
	if _, err := r.runHelm(ctx, "status", CNIRelease, "--namespace", Namespace); err == nil {
		// Installed (and patched): an upgrade would merge the chart's metrics port
		// back next to the patched one.
		return WaitIstioCNI(ctx, tb, o.Timeout)
	}
	if _, err := r.runHelm(ctx, "upgrade", "--install", CNIRelease, b.Chart("istio-cni"),
		"--namespace", Namespace, "--create-namespace", "--values", vf); err != nil {
		return err
	}
	if err := CNIHostNetwork(ctx, tb); err != nil {
		return err
	}
	return WaitIstioCNI(ctx, tb, o.Timeout)
}

// CNIHostNetwork patches install-cni's DaemonSet onto the host network: the test
// bed's adaptation of Istio's chart (as hostNetwork does for istiod; pods cannot reach
// the API server here). Its declared metrics port moves to CNIMonitoringPort: on the
// host network a declared port is a host port, and 15014 is istiod's (the kubelet
// would evict istiod for the node-critical install-cni pod).
func CNIHostNetwork(ctx context.Context, tb *testbed.Testbed) error {
	patch := []map[string]any{
		{"op": "add", "path": "/spec/template/spec/hostNetwork", "value": true},
		{"op": "add", "path": "/spec/template/spec/dnsPolicy", "value": string(corev1.DNSClusterFirstWithHostNet)},
		{"op": "replace", "path": "/spec/template/spec/containers/0/ports", "value": []corev1.ContainerPort{
			{Name: "metrics", ContainerPort: CNIMonitoringPort, Protocol: corev1.ProtocolTCP},
		}},
	}
	pb, err := json.Marshal(patch)
	if err != nil {
		return err
	}
	_, err = tb.Client.AppsV1().DaemonSets(Namespace).Patch(ctx, CNIDaemonSet, types.JSONPatchType, pb, metav1.PatchOptions{})
	if err != nil {
		return fmt.Errorf("patch %s/%s onto the host network: %w", Namespace, CNIDaemonSet, err)
	}
	return nil
}

// WaitIstioCNI waits until install-cni's DaemonSet is rolled out and ready on the
// host network and istio-cni is in the node's conflist.
func WaitIstioCNI(ctx context.Context, tb *testbed.Testbed, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var state string
	for {
		ds, err := tb.Client.AppsV1().DaemonSets(Namespace).Get(ctx, CNIDaemonSet, metav1.GetOptions{})
		chain, cerr := ChainTypes()
		if err == nil && cerr == nil && daemonSetReady(ds) && ds.Spec.Template.Spec.HostNetwork && slices.Contains(chain, CNIPluginType) {
			return nil
		}
		state = fmt.Sprintf("DaemonSet %v (%v), chain %q (%v)", dsStatus(ds), err, chain, cerr)
		select {
		case <-ctx.Done():
			return fmt.Errorf("istio-cni not ready: %w; %s", ctx.Err(), state)
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// UninstallIstioCNI uninstalls the istio-cni chart (helm uninstall --wait) and waits
// until no install-cni pod is left and istio-cni is out of the conflist and the
// plugin directory (install-cni removes both on exit).
func UninstallIstioCNI(ctx context.Context, tb *testbed.Testbed, o Options) error {
	o.defaults()
	r, err := newRunner(ctx, tb, o)
	if err != nil {
		return err
	}
	if _, err := r.runHelm(ctx, "uninstall", CNIRelease, "--namespace", Namespace, "--ignore-not-found", "--wait"); err != nil {
		return err
	}
	return WaitIstioCNIGone(ctx, tb, o.Timeout)
}

// WaitIstioCNIGone waits until no install-cni pod is left and neither the conflist
// nor the plugin directory holds istio-cni.
func WaitIstioCNIGone(ctx context.Context, tb *testbed.Testbed, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var state string
	for {
		pods, err := tb.Client.CoreV1().Pods(Namespace).List(ctx, metav1.ListOptions{LabelSelector: "k8s-app=" + CNIDaemonSet})
		chain, cerr := ChainTypes()
		_, serr := os.Stat(filepath.Join(testbed.CNIBinDir, CNIPluginType))
		if err == nil && len(pods.Items) == 0 && cerr == nil && !slices.Contains(chain, CNIPluginType) && os.IsNotExist(serr) {
			return nil
		}
		n := -1
		if pods != nil {
			n = len(pods.Items)
		}
		state = fmt.Sprintf("install-cni pods %d (%v), chain %q (%v), binary %v", n, err, chain, cerr, serr)
		select {
		case <-ctx.Done():
			return fmt.Errorf("istio-cni not gone: %w; %s", ctx.Err(), state)
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// ChainTypes lists the plugin types of the test bed's conflist, in chain order.
func ChainTypes() ([]string, error) {
	b, err := os.ReadFile(filepath.Join(testbed.CNIConfDir, testbed.DefaultConflistName))
	if err != nil {
		return nil, err
	}
	var conf struct {
		Plugins []struct {
			Type string `json:"type"`
		} `json:"plugins"`
	}
	if err := json.Unmarshal(b, &conf); err != nil {
		return nil, fmt.Errorf("%s: %w", testbed.DefaultConflistName, err)
	}
	types := make([]string, len(conf.Plugins))
	for i, p := range conf.Plugins {
		types[i] = p.Type
	}
	return types, nil
}

func daemonSetReady(ds *appsv1.DaemonSet) bool {
	s := ds.Status
	return s.ObservedGeneration >= ds.Generation && s.DesiredNumberScheduled > 0 &&
		s.UpdatedNumberScheduled == s.DesiredNumberScheduled && s.NumberReady == s.DesiredNumberScheduled &&
		s.NumberUnavailable == 0
}

func dsStatus(ds *appsv1.DaemonSet) any {
	if ds == nil {
		return nil
	}
	return ds.Status
}

// newRunner is a runner with helm found, for one Helm step.
func newRunner(ctx context.Context, tb *testbed.Testbed, o Options) (*runner, error) {
	helm, err := demo.HelmPath(ctx, o.RepoRoot)
	if err != nil {
		return nil, err
	}
	return &runner{o: o, tb: tb, helm: helm, inst: &Installed{}, last: time.Now()}, nil
}
