package plugin_test

// End-to-end tests of the meshcni binary: built with `go build`, run by its CNI
// contract (environment + stdin) or through libcni behind a test "prevResult"
// plugin, against a real API server (internal/env/testbed, API-only mode) and in real network
// namespaces with pkg/engine's real backends.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/podget"
)

var (
	buildOnce sync.Once
	binDir    string
	buildErr  error
)

// hostNetnsPath names, through a file descriptor held open for the whole run, the
// network namespace the test binary started in.
var hostNetnsPath string

func TestMain(m *testing.M) {
	if f, err := os.Open("/proc/thread-self/ns/net"); err == nil {
		hostNetnsPath = fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), f.Fd())
		defer f.Close()
	}
	code := testbed.RunMain(m)
	if binDir != "" {
		os.RemoveAll(binDir)
	}
	os.Exit(code)
}

// binaries builds meshcni, its API helper meshcni-podget (next to it, where the plugin
// looks for it) and the test prevplugin once per test binary.
func binaries(t testing.TB) string {
	t.Helper()
	gobin := testutil.RequireBinary(t, "go")
	buildOnce.Do(func() {
		binDir, buildErr = os.MkdirTemp("", "meshcni-plugin-test-")
		if buildErr != nil {
			return
		}
		root, err := testutil.RepoRoot()
		if err != nil {
			buildErr = err
			return
		}
		for name, pkg := range map[string]string{"meshcni": "./cmd/meshcni", podget.HelperName: "./cmd/meshcni-podget", "prevplugin": "./pkg/plugin/testdata/prevplugin"} {
			cmd := exec.Command(gobin, "build", "-trimpath", "-o", filepath.Join(binDir, name), pkg)
			cmd.Dir = root
			cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
			if out, err := cmd.CombinedOutput(); err != nil {
				buildErr = fmt.Errorf("go build %s: %v\n%s", pkg, err, out)
				return
			}
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return binDir
}

// testbedAPI is the package's shared test bed (internal/env/testbed, full mode: the API
// server tests need only its API; the kubelet test needs the node).
func testbedAPI(t testing.TB) *testbed.Testbed {
	t.Helper()
	return testbed.Shared(t)
}

// runPlugin runs the binary by the CNI contract and returns stdout and the exit code.
func runPlugin(t *testing.T, bin, command, netns string, args string, stdin []byte) ([]byte, string, int) {
	t.Helper()
	cmd := exec.Command(bin)
	cmd.Env = []string{"CNI_COMMAND=" + command, "CNI_CONTAINERID=c0ffee", "CNI_NETNS=" + netns, "CNI_IFNAME=eth0", "CNI_PATH=" + filepath.Dir(bin), "CNI_ARGS=" + args}
	cmd.Stdin = bytes.NewReader(stdin)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	code := 0
	if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return stdout.Bytes(), stderr.String(), code
}

func mustJSON(t testing.TB, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func prevResult(ips ...string) map[string]any {
	var list []map[string]any
	for _, ip := range ips {
		list = append(list, map[string]any{"interface": 0, "address": ip})
	}
	return map[string]any{"cniVersion": "1.0.0", "interfaces": []map[string]any{{"name": "eth0", "sandbox": "/x"}}, "ips": list}
}

func meshcniEntry(runDir, kubeconfig string, extra map[string]any) map[string]any {
	m := map[string]any{
		"type":               "meshcni",
		"plugin_log_level":   "debug",
		"cni_agent_run_dir":  runDir,
		"exclude_namespaces": []string{"kube-system"},
		"api_timeout":        "3s",
	}
	if kubeconfig != "" {
		m["kubernetes"] = map[string]any{"kubeconfig": kubeconfig, "cni_bin_dir": "/opt/cni/bin"}
	}
	for k, v := range extra {
		m[k] = v
	}
	return m
}

func cniError(t *testing.T, stdout []byte, code int) *types.Error {
	t.Helper()
	if code == 0 {
		t.Fatalf("exit 0, stdout %s", stdout)
	}
	var e types.Error
	if err := json.Unmarshal(stdout, &e); err != nil {
		t.Fatalf("stdout %q is not a CNI error: %v", stdout, err)
	}
	return &e
}

// TestBinaryContract runs the binary's error paths by the CNI contract (no root).
func TestBinaryContract(t *testing.T) {
	bin := filepath.Join(binaries(t), "meshcni")
	runDir := t.TempDir()
	k8sArgs := "K8S_POD_NAMESPACE=app;K8S_POD_NAME=web;K8S_POD_UID=u1"
	withConf := func(ver string, prev any, extra map[string]any) []byte {
		m := meshcniEntry(runDir, "", extra)
		m["cniVersion"], m["name"] = ver, "net"
		if prev != nil {
			m["prevResult"] = prev
		}
		return mustJSON(t, m)
	}

	t.Run("VERSION", func(t *testing.T) {
		out, _, code := runPlugin(t, bin, "VERSION", "", "", []byte(`{"cniVersion":"1.1.0"}`))
		if code != 0 || !strings.Contains(string(out), `"supportedVersions":["0.3.0","0.3.1","0.4.0","1.0.0","1.1.0"]`) {
			t.Fatalf("exit %d: %s", code, out)
		}
	})
	t.Run("malformed config JSON", func(t *testing.T) {
		out, _, code := runPlugin(t, bin, "ADD", "/var/run/netns/meshcni-test-none", k8sArgs, []byte(`{"cniVersion":"1.0.0","name":"net","type":"meshcni",`))
		e := cniError(t, out, code)
		if e.Code != types.ErrDecodingFailure {
			t.Fatalf("%+v", e)
		}
	})
	t.Run("bad field", func(t *testing.T) {
		out, _, code := runPlugin(t, bin, "ADD", "/var/run/netns/meshcni-test-none", k8sArgs, withConf("1.0.0", prevResult("10.0.0.2/24"), map[string]any{"exclude_namespaces": "kube-system"}))
		e := cniError(t, out, code)
		if e.Code != types.ErrDecodingFailure || !strings.Contains(e.Msg, "exclude_namespaces") {
			t.Fatalf("%+v", e)
		}
		out, _, code = runPlugin(t, bin, "ADD", "/var/run/netns/meshcni-test-none", k8sArgs, withConf("1.0.0", prevResult("10.0.0.2/24"), map[string]any{"backend": "ebpf"}))
		e = cniError(t, out, code)
		if e.Code != types.ErrInvalidNetworkConfig || !strings.Contains(e.Msg, `invalid backend "ebpf"`) {
			t.Fatalf("%+v", e)
		}
	})
	t.Run("no prevResult: an empty result of the requested version", func(t *testing.T) {
		// A network of its own (Multus): nothing to pass through. A meshed pod without
		// a prevResult: TestMultusStandaloneList.
		for _, ver := range []string{"0.3.1", "1.0.0", "1.1.0"} {
			out, stderr, code := runPlugin(t, bin, "ADD", "/var/run/netns/meshcni-test-none", "K8S_POD_NAMESPACE=kube-system;K8S_POD_NAME=dns", withConf(ver, nil, nil))
			var r map[string]any
			if code != 0 || json.Unmarshal(out, &r) != nil || r["cniVersion"] != ver || r["ips"] != nil || r["interfaces"] != nil {
				t.Fatalf("%s: exit %d, stdout %s, stderr %s", ver, code, out, stderr)
			}
		}
	})
	t.Run("unsupported cniVersion", func(t *testing.T) {
		out, _, code := runPlugin(t, bin, "ADD", "/var/run/netns/meshcni-test-none", k8sArgs, withConf("0.2.0", nil, nil))
		e := cniError(t, out, code)
		if e.Code != types.ErrIncompatibleCNIVersion || !strings.Contains(e.Details, "0.2.0") {
			t.Fatalf("%+v", e)
		}
	})
	t.Run("API down fails closed within the deadline", func(t *testing.T) {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := l.Addr().String()
		l.Close()
		kc := filepath.Join(t.TempDir(), "kc")
		doc := fmt.Sprintf("current-context: x\nclusters: [{name: c, cluster: {server: 'https://%s', insecure-skip-tls-verify: true}}]\nusers: [{name: u, user: {token: t}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\n", addr)
		if err := os.WriteFile(kc, []byte(doc), 0o600); err != nil {
			t.Fatal(err)
		}
		m := meshcniEntry(runDir, kc, map[string]any{"api_timeout": "1s"})
		m["cniVersion"], m["name"], m["prevResult"] = "1.0.0", "net", prevResult("10.0.0.2/24")
		start := time.Now()
		out, _, code := runPlugin(t, bin, "ADD", "/var/run/netns/meshcni-test-none", k8sArgs, mustJSON(t, m))
		took := time.Since(start)
		e := cniError(t, out, code)
		want := "cannot reach the Kubernetes API at https://" + addr
		if e.Code != types.ErrTryAgainLater || !strings.Contains(e.Msg, want) || !strings.Contains(e.Msg, "fails closed so the pod is not started unredirected") ||
			!strings.Contains(e.Msg, "check that meshcni-agent is running on this node") {
			t.Fatalf("%+v", e)
		}
		if took < time.Second || took > 4*time.Second {
			t.Fatalf("took %s with api_timeout 1s", took)
		}
	})
	t.Run("STATUS not ready without the agent's kubeconfig", func(t *testing.T) {
		out, _, code := runPlugin(t, bin, "STATUS", "", "", withConf("1.1.0", nil, nil))
		e := cniError(t, out, code)
		if e.Code != types.ErrPluginNotAvailable || !strings.Contains(e.Msg, "meshcni-kubeconfig is missing") {
			t.Fatalf("%+v", e)
		}
		if err := os.WriteFile(filepath.Join(runDir, "meshcni-kubeconfig"), []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
		defer os.Remove(filepath.Join(runDir, "meshcni-kubeconfig"))
		if out, _, code := runPlugin(t, bin, "STATUS", "", "", withConf("1.1.0", nil, nil)); code != 0 {
			t.Fatalf("ready: exit %d %s", code, out)
		}
	})
	t.Run("non-Kubernetes and excluded calls need no kubeconfig", func(t *testing.T) {
		for _, args := range []string{"", "K8S_POD_NAMESPACE=kube-system;K8S_POD_NAME=dns"} {
			prev := prevResult("10.0.0.2/24")
			prev["cniVersion"] = "0.4.0"
			prev["ips"].([]map[string]any)[0]["version"] = "4"
			out, stderr, code := runPlugin(t, bin, "ADD", "/var/run/netns/meshcni-test-none", args, withConf("0.4.0", prev, nil))
			if code != 0 {
				t.Fatalf("exit %d %s %s", code, out, stderr)
			}
			var r map[string]any
			if err := json.Unmarshal(out, &r); err != nil || r["cniVersion"] != "0.4.0" {
				t.Fatalf("result %s: %v", out, err)
			}
		}
	})
}

// chain is a libcni conflist: the test prevplugin (reporting ips), then meshcni
// (when entry is not nil).
type chain struct {
	cfg   *libcni.CNIConfig
	list  *libcni.NetworkConfigList
	cache string
}

func newChain(t testing.TB, ips []string, entry map[string]any) *chain {
	t.Helper()
	return newChainIn(t, binaries(t), ips, entry)
}

// newChainIn is newChain with the plugins of dir.
func newChainIn(t testing.TB, dir string, ips []string, entry map[string]any) *chain {
	t.Helper()
	plugins := []map[string]any{{"type": "prevplugin", "result": prevResult(ips...)}}
	if entry != nil {
		plugins = append(plugins, entry)
	}
	list, err := libcni.ConfListFromBytes(mustJSON(t, map[string]any{"cniVersion": "1.0.0", "name": "e2e", "plugins": plugins}))
	if err != nil {
		t.Fatal(err)
	}
	cache := t.TempDir()
	return &chain{cfg: libcni.NewCNIConfigWithCacheDir([]string{dir}, cache, nil), list: list, cache: cache}
}

func runtimeConf(netns string, pod *corev1.Pod) *libcni.RuntimeConf {
	return &libcni.RuntimeConf{
		ContainerID: fmt.Sprintf("c%d", rand.Uint64()),
		NetNS:       netns,
		IfName:      "eth0",
		Args: [][2]string{
			{"IgnoreUnknown", "1"},
			{"K8S_POD_NAMESPACE", pod.Namespace},
			{"K8S_POD_NAME", pod.Name},
			{"K8S_POD_INFRA_CONTAINER_ID", "infra"},
			{"K8S_POD_UID", string(pod.UID)},
		},
	}
}

// ensureNamespace creates a namespace and its default ServiceAccount (no
// controller-manager runs in API-only mode to create it).
func ensureNamespace(t testing.TB, name string) {
	t.Helper()
	ctx := context.Background()
	c := testbedAPI(t).Client
	if _, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatalf("create namespace %s: %v", name, err)
	}
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default", Namespace: name}}
	if _, err := c.CoreV1().ServiceAccounts(name).Create(ctx, sa, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatalf("create service account: %v", err)
	}
}

// createPod stores a pod in the real API server and deletes it when the test ends.
// A scheduling gate keeps it from ever being scheduled: only its API object matters.
func createPod(t testing.TB, pod *corev1.Pod) *corev1.Pod {
	t.Helper()
	c := testbedAPI(t).Client
	ensureNamespace(t, pod.Namespace)
	pod.Name = fmt.Sprintf("%s-%04x", pod.Name, rand.Uint32()&0xffff)
	no := false
	pod.Spec.AutomountServiceAccountToken = &no
	pod.Spec.SchedulingGates = append(pod.Spec.SchedulingGates, corev1.PodSchedulingGate{Name: "meshcni.test/never"})
	created, err := c.CoreV1().Pods(pod.Namespace).Create(context.Background(), pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create pod %s/%s: %v", pod.Namespace, pod.Name, err)
	}
	t.Cleanup(func() {
		zero := int64(0)
		_ = c.CoreV1().Pods(pod.Namespace).Delete(context.Background(), pod.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero})
	})
	return created
}
