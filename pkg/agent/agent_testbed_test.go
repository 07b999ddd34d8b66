package agent_test

// The real-node proof: the meshcni-agent binary, as a host process, installs meshcni
// into the test bed's real CNI configuration directory (internal/env/testbed, full mode);
// kubelet and containerd then run a meshed and a plain pod through the chain; metrics
// are scraped over HTTP and parsed; SIGTERM uninstalls (or keeps, with
// --keep-on-exit).

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/testkit/agenttest"
	"github.com/meshcni/meshcni/pkg/agent"
	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/capture/k8spod"
	"github.com/meshcni/meshcni/pkg/engine"
	"github.com/meshcni/meshcni/pkg/fileutil"
	"github.com/meshcni/meshcni/pkg/podget"
)

func TestMain(m *testing.M) {
	code := testbed.RunMain(m)
	agenttest.RemoveBinaries()
	os.Exit(code)
}

const e2eNS = "agent-e2e"

// primaryPath is the test bed's CNI configuration, the agent's primary.
var primaryPath = filepath.Join(testbed.CNIConfDir, testbed.DefaultConflistName)

// pluginTypes returns the types of the plugins of a conflist file, in order.
func pluginTypes(t *testing.T, path string) []string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var l struct {
		Plugins []struct {
			Type string `json:"type"`
		} `json:"plugins"`
	}
	if err := json.Unmarshal(b, &l); err != nil {
		t.Fatalf("%s: %v\n%s", path, err, b)
	}
	var types []string
	for _, p := range l.Plugins {
		types = append(types, p.Type)
	}
	return types
}

func hasMeshcni(types []string) bool {
	for _, ty := range types {
		if ty == "meshcni" {
			return true
		}
	}
	return false
}

// waitFor polls cond every 20 ms until it returns nil or d passes.
func waitFor(t *testing.T, d time.Duration, what string, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v: %v", what, d, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// metricAtLeast waits until the agent's metric (sample with labels) is ≥ min.
func metricAtLeast(t *testing.T, a *agenttest.Agent, name string, labels map[string]string, min float64) float64 {
	t.Helper()
	var v float64
	waitFor(t, 30*time.Second, fmt.Sprintf("%s%v ≥ %v", name, labels, min), func() error {
		fams, err := a.Scrape()
		if err != nil {
			return err
		}
		var ok bool
		if v, ok = agenttest.Value(fams, name, labels); !ok || v < min {
			return fmt.Errorf("%s%v = %v (present %v)", name, labels, v, ok)
		}
		return nil
	})
	return v
}

func value(t *testing.T, fams map[string]*dto.MetricFamily, name string, labels map[string]string) float64 {
	t.Helper()
	v, ok := agenttest.Value(fams, name, labels)
	if !ok {
		t.Fatalf("no sample %s%v", name, labels)
	}
	return v
}

// meshedPod is testbed.EchoPod with Istio's injection: the status annotation and an
// istio-proxy container (the echo image on the excluded port 15021), no readiness
// probe (kubelet's probe would be redirected to a proxy that is not there).
func meshedPod(name string) *corev1.Pod {
	p := testbed.EchoPod(name, 0)
	p.Namespace = e2eNS
	p.Annotations = map[string]string{capture.AnnotationStatus: `{"containers":["istio-proxy"]}`}
	p.Spec.Containers[0].ReadinessProbe = nil
	p.Spec.Containers = append(p.Spec.Containers, corev1.Container{
		Name: capture.ProxyContainer, Image: testbed.EchoImage, ImagePullPolicy: corev1.PullNever,
		Env: []corev1.EnvVar{{Name: "PORT", Value: "15021"}},
	})
	return p
}

func TestAgentOnTestbed(t *testing.T) {
	tb := testbed.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	if err := tb.CreateNamespace(ctx, e2eNS); err != nil && !apierrors.IsAlreadyExists(err) && !strings.Contains(err.Error(), "already exists") {
		t.Fatal(err)
	}
	orig, err := os.ReadFile(primaryPath)
	if err != nil {
		t.Fatal(err)
	}
	if hasMeshcni(pluginTypes(t, primaryPath)) {
		t.Fatalf("the test bed's configuration already chains meshcni:\n%s", orig)
	}

	// 1. The plugin source is missing at start: the agent serves, /readyz is 503
	// naming the binary, and the node's configuration is not touched.
	src := filepath.Join(t.TempDir(), "meshcni")
	began := time.Now()
	a := agenttest.Start(t, agenttest.Options{PluginBinary: src, NoWaitReady: true, Args: []string{"--resync", "200ms"}})
	ready, body, err := a.Ready()
	if err != nil || ready || !strings.Contains(body, "binary") {
		t.Fatalf("/readyz ready=%v err=%v body=%q; want 503 naming the binary", ready, err, body)
	}
	if b, _ := os.ReadFile(primaryPath); string(b) != string(orig) {
		t.Fatalf("configuration changed before the binary is in place:\n%s", b)
	}
	fams := a.Metrics(t)
	if v := value(t, fams, "meshcni_agent_ready", nil); v != 0 {
		t.Fatalf("meshcni_agent_ready = %v while not ready", v)
	}
	metricAtLeast(t, a, "meshcni_agent_installs_total", map[string]string{"result": "error"}, 1)

	// 2. The binary appears: the next resync installs binary, kubeconfig (in already)
	// and the entry, and /readyz flips to 200.
	// (Its API helper first: the agent installs the two together.)
	helper, err := os.ReadFile(filepath.Join(agenttest.Binaries(t), podget.HelperName))
	if err != nil {
		t.Fatal(err)
	}
	if err := fileutil.WriteFileAtomic(filepath.Join(filepath.Dir(src), podget.HelperName), helper, 0o755); err != nil {
		t.Fatal(err)
	}
	plugin, err := os.ReadFile(filepath.Join(agenttest.Binaries(t), agenttest.PluginBinary))
	if err != nil {
		t.Fatal(err)
	}
	if err := fileutil.WriteFileAtomic(src, plugin, 0o755); err != nil {
		t.Fatal(err)
	}
	flip := time.Now()
	if err := a.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	t.Logf("/readyz 503 → 200 %v after the binary appeared (agent started %v before)", time.Since(flip).Round(time.Millisecond), time.Since(began).Round(time.Millisecond))
	if types := pluginTypes(t, primaryPath); len(types) == 0 || types[len(types)-1] != "meshcni" {
		t.Fatalf("meshcni is not last in the chain: %v", types)
	}
	if got, err := os.ReadFile(filepath.Join(testbed.CNIBinDir, "meshcni")); err != nil || string(got) != string(plugin) {
		t.Fatalf("installed binary: err %v, equal %v", err, string(got) == string(plugin))
	}
	if got, err := os.ReadFile(filepath.Join(testbed.CNIBinDir, podget.HelperName)); err != nil || string(got) != string(helper) {
		t.Fatalf("installed API helper: err %v, equal %v", err, string(got) == string(helper))
	}
	kcPath := filepath.Join(a.RunDir, agent.KubeconfigName)
	if fi, err := os.Stat(kcPath); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("plugin kubeconfig: %v %v", fi, err)
	}
	fams = a.Metrics(t)
	if v := value(t, fams, "meshcni_agent_ready", nil); v != 1 {
		t.Fatalf("meshcni_agent_ready = %v once ready", v)
	}
	if v := value(t, fams, "meshcni_agent_installs_total", map[string]string{"result": "success"}); v < 3 {
		t.Fatalf("installs success = %v, want ≥ 3 (kubeconfig, binary, entry)", v)
	}
	if v := value(t, fams, "meshcni_agent_reinjections_total", nil); v != 0 {
		t.Fatalf("reinjections = %v before any rewrite", v)
	}

	// 3. The primary CNI rewrites its file as it knows it (without our entry): the
	// guard puts the entry back and counts one re-injection.
	rewrote := time.Now()
	if err := fileutil.WriteFileAtomic(primaryPath, orig, 0o644); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "entry put back", func() error {
		if !hasMeshcni(pluginTypes(t, primaryPath)) {
			return fmt.Errorf("no meshcni entry")
		}
		return nil
	})
	t.Logf("entry put back %v after the primary's rewrite", time.Since(rewrote).Round(time.Millisecond))
	if v := metricAtLeast(t, a, "meshcni_agent_reinjections_total", nil, 1); v != 1 {
		t.Fatalf("reinjections = %v after one rewrite", v)
	}
	if err := a.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}

	// 4. kubelet runs a meshed pod through the chain: the rules are in its netns, and
	// the plugin reported its ADD to this agent.
	meshed, err := tb.CreatePod(ctx, meshedPod("agent-meshed"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tb.DeletePod(context.Background(), e2eNS, meshed.Name) })
	if meshed, err = tb.WaitPodRunning(ctx, e2eNS, meshed.Name); err != nil {
		t.Fatal(err)
	}
	netns, err := tb.PodNetns(ctx, e2eNS, meshed.Name)
	if err != nil {
		t.Fatal(err)
	}
	s, err := capture.Spec(k8spod.From(meshed))
	if err != nil {
		t.Fatal(err)
	}
	var ips []netip.Addr
	for _, ip := range meshed.Status.PodIPs {
		ips = append(ips, netip.MustParseAddr(ip.IP))
	}
	capture.WithFamilies(s, ips)
	if d, err := engine.Check(ctx, engine.Options{Backend: backend.Auto, NetnsPath: netns}, s); err != nil || !d.Empty() {
		t.Fatalf("meshcni's rules in the meshed pod: err %v, drift:\n%s", err, d)
	}
	addOK := map[string]string{"command": "ADD", "result": "success"}
	metricAtLeast(t, a, "meshcni_plugin_cmd_total", addOK, 1)
	metricAtLeast(t, a, "meshcni_plugin_add_duration_seconds", map[string]string{"result": "success"}, 1)
	waitFor(t, 10*time.Second, "the plugin's log line in the agent's log", func() error {
		for _, line := range strings.Split(a.Log(), "\n") {
			if strings.Contains(line, `"source":"plugin"`) && strings.Contains(line, `"pod_name":"agent-meshed"`) &&
				strings.Contains(line, "redirect applied") {
				return nil
			}
		}
		return fmt.Errorf("no plugin record for agent-meshed")
	})

	// 5. A plain pod goes through the same chain and gets no rules.
	plainSpec := testbed.EchoPod("agent-plain", 0)
	plainSpec.Namespace = e2eNS
	plain, err := tb.CreatePod(ctx, plainSpec)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tb.DeletePod(context.Background(), e2eNS, plain.Name) })
	if _, err = tb.WaitPodReady(ctx, e2eNS, plain.Name); err != nil {
		t.Fatal(err)
	}
	pnetns, err := tb.PodNetns(ctx, e2eNS, plain.Name)
	if err != nil {
		t.Fatal(err)
	}
	live, err := engine.Live(ctx, engine.Options{Backend: backend.Auto, NetnsPath: pnetns})
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range live {
		if strings.TrimSpace(v) != "" {
			t.Fatalf("%s rules in the plain pod:\n%s", k, v)
		}
	}
	adds := metricAtLeast(t, a, "meshcni_plugin_cmd_total", addOK, 2)
	hist := metricAtLeast(t, a, "meshcni_plugin_add_duration_seconds", map[string]string{"result": "success"}, 2)
	t.Logf("plugin ADD success count %v, ADD latency histogram count %v", adds, hist)

	// Pods leave while the agent runs: their DEL goes through meshcni too.
	for _, p := range []string{meshed.Name, plain.Name} {
		if err := tb.DeletePod(ctx, e2eNS, p); err != nil {
			t.Fatal(err)
		}
	}
	metricAtLeast(t, a, "meshcni_plugin_cmd_total", map[string]string{"command": "DEL", "result": "success"}, 1)

	// 6. SIGTERM: entry, binary and kubeconfig removed; the configuration is what it
	// was (agenttest also compares the whole directory when the test ends).
	if err := a.Stop(); err != nil {
		t.Fatal(err)
	}
	if hasMeshcni(pluginTypes(t, primaryPath)) {
		t.Fatal("entry left after SIGTERM")
	}
	for _, p := range []string{filepath.Join(testbed.CNIBinDir, "meshcni"), filepath.Join(testbed.CNIBinDir, podget.HelperName), kcPath} {
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Fatalf("%s left after SIGTERM (stat: %v)", p, err)
		}
	}

	// 7. --keep-on-exit: everything stays for the next agent (rolling upgrade).
	k := agenttest.Start(t, agenttest.Options{Args: []string{"--keep-on-exit"}})
	if err := k.Stop(); err != nil {
		t.Fatal(err)
	}
	if !hasMeshcni(pluginTypes(t, primaryPath)) {
		t.Fatal("entry removed despite --keep-on-exit")
	}
	for _, p := range []string{filepath.Join(testbed.CNIBinDir, "meshcni"), filepath.Join(testbed.CNIBinDir, podget.HelperName), filepath.Join(k.RunDir, agent.KubeconfigName)} {
		if _, err := os.Stat(p); err != nil {
			t.Fatalf("%s removed despite --keep-on-exit: %v", p, err)
		}
	}
}
