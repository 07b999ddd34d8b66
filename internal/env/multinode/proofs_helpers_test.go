package multinode_test

// Helpers of the cross-node, node-local and node-death proofs (crossnode_test.go,
// nodelocal_test.go, nodedeath_test.go): the demo's pods pinned to a node, probes
// from inside a pod, the stand-in proxy's records, the agents by node, their metrics
// and processes, and the redirect read back from a pod's network namespace.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/internal/env/demo"
	"github.com/meshcni/meshcni/internal/env/multinode"
	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/standin/proxysim"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/internal/tools/build/image"
	"github.com/meshcni/meshcni/pkg/cniconf"
	"github.com/meshcni/meshcni/pkg/engine"
)

// pollEvery is how often the proofs poll the API server and the nodes.
const pollEvery = 150 * time.Millisecond

// demoPod is one of the demo's pods (demo.MeshedPod: an Istio-style meshed pod whose
// istio-validation runs `meshcnictl validate` as UID 1337, its app the stand-in in
// record mode on demo.AppPort as UID 1000, its istio-proxy the stand-in forwarding
// as UID 1337 and reading SO_ORIGINAL_DST; demo.PlainPod: the same app, no sidecar)
// named name in ns, pinned to node ("" = anywhere).
func demoPod(c *multinode.Cluster, which, ns, name, node string) *corev1.Pod {
	for _, p := range demo.Pods(c.MeshcniImage, c.ProxyImage) {
		if p.Name != which {
			continue
		}
		p.Name, p.Namespace = name, ns
		p.Labels = map[string]string{"app": name}
		if node != "" {
			p.Spec.NodeSelector = map[string]string{corev1.LabelHostname: node}
		}
		return p
	}
	panic("demo has no pod " + which)
}

// startPods creates the pods and waits until all are Ready and their stand-ins
// listen (each printed its ready record); it returns them as the API has them.
func startPods(ctx context.Context, t *testing.T, tb *testbed.Testbed, pods ...*corev1.Pod) map[string]*corev1.Pod {
	t.Helper()
	for _, p := range pods {
		if _, err := tb.CreatePod(ctx, p); err != nil {
			t.Fatal(err)
		}
	}
	out := map[string]*corev1.Pod{}
	for _, p := range pods {
		got, err := tb.WaitPodReady(ctx, p.Namespace, p.Name)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range got.Spec.Containers {
			if len(c.Command) > 0 && c.Command[0] == image.ProxysimPath {
				waitListening(ctx, t, tb, got, c.Name)
			}
		}
		out[p.Name] = got
	}
	return out
}

// waitListening waits for the ready record of a stand-in container (its listeners bound).
func waitListening(ctx context.Context, t *testing.T, tb *testbed.Testbed, p *corev1.Pod, container string) {
	t.Helper()
	pollUntil(ctx, t, time.Minute, p.Name+"/"+container+" listening", func() error {
		for _, r := range podRecords(ctx, tb, p, container) {
			if r.Event == proxysim.EventReady {
				return nil
			}
		}
		return errors.New("no ready record in its log yet")
	})
}

// podRecords are the stand-in's JSON records in a container's log (other lines skipped).
func podRecords(ctx context.Context, tb *testbed.Testbed, p *corev1.Pod, container string) []proxysim.Record {
	logs, err := tb.PodLogs(ctx, p.Namespace, p.Name, container)
	if err != nil {
		return nil
	}
	var out []proxysim.Record
	for line := range strings.SplitSeq(logs, "\n") {
		line = strings.TrimSpace(line)
		if !strings.HasPrefix(line, "{") {
			continue
		}
		var r proxysim.Record
		if json.Unmarshal([]byte(line), &r) == nil && r.Event != "" {
			out = append(out, r)
		}
	}
	return out
}

// connRecord waits for the proxy's record of the connection from peer on listener.
func connRecord(ctx context.Context, t *testing.T, tb *testbed.Testbed, p *corev1.Pod, listener string, peer netip.AddrPort) proxysim.Record {
	t.Helper()
	var found proxysim.Record
	pollUntil(ctx, t, 20*time.Second, fmt.Sprintf("%s's proxy: a %s record of the connection from %v", p.Name, listener, peer), func() error {
		for _, r := range podRecords(ctx, tb, p, demo.ProxyContainer) {
			if r.Event == proxysim.EventConn && r.Listener == listener && r.Peer == peer {
				found = r
				return nil
			}
		}
		return errors.New("none yet")
	})
	return found
}

// connsFrom lists the proxy's connection records whose peer has address from.
func connsFrom(ctx context.Context, tb *testbed.Testbed, p *corev1.Pod, from netip.Addr) []proxysim.Record {
	var out []proxysim.Record
	for _, r := range podRecords(ctx, tb, p, demo.ProxyContainer) {
		if r.Event == proxysim.EventConn && r.Peer.Addr() == from {
			out = append(out, r)
		}
	}
	return out
}

// probeFrom connects from inside a pod's container (as that container's UID) to dst
// with the stand-in's client, and returns what the client saw.
func probeFrom(ctx context.Context, t *testing.T, tb *testbed.Testbed, p *corev1.Pod, container string, dst netip.AddrPort) proxysim.ProbeResult {
	t.Helper()
	stdout, stderr, err := tb.Exec(ctx, p.Namespace, p.Name, container, image.ProxysimPath, "client",
		"--connect", dst.String(), "--send", "hello from "+p.Name+"\n", "--timeout", "5s")
	if err != nil {
		t.Fatalf("%s/%s → %v: %v (%s)", p.Name, container, dst, err, strings.TrimSpace(stderr))
	}
	var res proxysim.ProbeResult
	if err := json.Unmarshal([]byte(stdout), &res); err != nil {
		t.Fatalf("%s/%s → %v: probe output %q: %v", p.Name, container, dst, stdout, err)
	}
	if !res.Connected || res.Error != "" {
		t.Fatalf("%s/%s → %v: not connected: %+v", p.Name, container, dst, res)
	}
	return res
}

// appPeer is the client address the destination app (the stand-in in record mode)
// reported in its answer: one JSON record naming the connection's peer.
func appPeer(t *testing.T, res proxysim.ProbeResult) netip.AddrPort {
	t.Helper()
	first, _, _ := strings.Cut(res.Reply, "\n")
	var r proxysim.Record
	if err := json.Unmarshal([]byte(first), &r); err != nil || !r.Peer.IsValid() {
		t.Fatalf("the destination's answer %q is not the app's record: %v", res.Reply, err)
	}
	return r.Peer
}

func podAddr(t *testing.T, p *corev1.Pod, port uint16) netip.AddrPort {
	t.Helper()
	ip, err := netip.ParseAddr(p.Status.PodIP)
	if err != nil {
		t.Fatalf("pod %s IP %q: %v", p.Name, p.Status.PodIP, err)
	}
	return netip.AddrPortFrom(ip, port)
}

// liveRules returns meshcni's rules in a pod's network namespace, of every backend
// ("" when there are none).
func liveRules(ctx context.Context, t *testing.T, tb *testbed.Testbed, p *corev1.Pod) string {
	t.Helper()
	netns, err := tb.PodNetns(ctx, p.Namespace, p.Name)
	if err != nil {
		t.Fatal(err)
	}
	live, err := engine.Live(ctx, engine.Options{NetnsPath: netns})
	if err != nil {
		t.Fatalf("live rules of %s in %s: %v", p.Name, netns, err)
	}
	var b strings.Builder
	for k, txt := range live {
		if strings.TrimSpace(txt) != "" {
			fmt.Fprintf(&b, "%s:\n%s\n", k, txt)
		}
	}
	return b.String()
}

// redirected: the pod started redirected and still is, audited from its own node
// (multinode.Cluster.Redirected: istio-validation passed on its first run, meshcnictl
// inspect finds meshcni's rules in sync).
func redirected(ctx context.Context, t *testing.T, c *multinode.Cluster, p *corev1.Pod) {
	t.Helper()
	if err := c.Redirected(ctx, p); err != nil {
		t.Error(err)
	}
}

// validationRuns is the pod's istio-validation container: its restarts and the exit
// code of its completed (or last) run, -1 when none ended.
func validationRuns(p *corev1.Pod) (restarts int32, exit int32) {
	for _, s := range p.Status.InitContainerStatuses {
		if s.Name != demo.ValidationContainer {
			continue
		}
		switch {
		case s.State.Terminated != nil:
			return s.RestartCount, s.State.Terminated.ExitCode
		case s.LastTerminationState.Terminated != nil:
			return s.RestartCount, s.LastTerminationState.Terminated.ExitCode
		}
		return s.RestartCount, -1
	}
	return 0, -1
}

// agentsByNode returns the Ready agent pod of every node.
func agentsByNode(ctx context.Context, t *testing.T, c *multinode.Cluster) map[string]*corev1.Pod {
	t.Helper()
	out := map[string]*corev1.Pod{}
	for _, n := range c.TB.Nodes() {
		p, err := c.AgentPod(ctx, n.Name)
		if err != nil {
			t.Fatal(err)
		}
		if !multinode.PodReady(p) {
			t.Fatalf("agent pod %s on %s not Ready", p.Name, n.Name)
		}
		out[n.Name] = p
	}
	return out
}

func restartsOf(p *corev1.Pod) int32 {
	var n int32
	for _, s := range p.Status.ContainerStatuses {
		n += s.RestartCount
	}
	return n
}

// counters are an agent's counter samples by name{labels}.
type counters map[string]float64

// scrapeCounters reads every sample of the named counter families from the
// node's agent.
func scrapeCounters(ctx context.Context, t *testing.T, c *multinode.Cluster, node string, families ...string) counters {
	t.Helper()
	text, err := c.AgentMetrics(ctx, node)
	if err != nil {
		t.Fatal(err)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(strings.NewReader(text))
	if err != nil {
		t.Fatalf("parse the metrics of the agent on %s: %v", node, err)
	}
	out := counters{}
	for _, name := range families {
		f, ok := fams[name]
		if !ok {
			t.Fatalf("the agent on %s exports no %s", node, name)
		}
		for _, m := range f.Metric {
			out[sampleName(name, m)] = m.GetCounter().GetValue()
		}
	}
	return out
}

func sampleName(name string, m *dto.Metric) string {
	var kv []string
	for _, l := range m.Label {
		kv = append(kv, l.GetName()+"="+strconv.Quote(l.GetValue()))
	}
	slices.Sort(kv)
	return name + "{" + strings.Join(kv, ",") + "}"
}

// agentProcess finds the agent container's process on the host (the nodes share the
// host's PID namespace).
func agentProcess(t *testing.T, agent *corev1.Pod) int {
	t.Helper()
	pid, err := testbed.ContainerProcess(agent, "agent", image.AgentCommand)
	if err != nil {
		t.Fatal(err)
	}
	return pid
}

// takeMeshcniOut removes meshcni's entry from the node's conflist that holds it
// (temp file + rename, as another writer would) and returns the file and its content.
func takeMeshcniOut(t *testing.T, n *testbed.Node) (string, []byte) {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(n.CNIConfDir(), "*.conflist"))
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		out, removed, err := cniconf.Remove(data)
		if err != nil || removed == 0 {
			continue
		}
		if err := replaceFile(f, out); err != nil {
			t.Fatal(err)
		}
		return f, data
	}
	t.Fatalf("no conflist in %s (node %s) holds meshcni", n.CNIConfDir(), n.Name)
	return "", nil
}

func hasMeshcni(file string) bool {
	data, err := os.ReadFile(file)
	if err != nil {
		return false
	}
	_, removed, err := cniconf.Remove(data)
	return err == nil && removed > 0
}

func replaceFile(path string, data []byte) error {
	tmp := path + ".multinode-test.tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return fmt.Errorf("write %s: %w", tmp, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("rename %s: %w", tmp, err)
	}
	return nil
}

// pollUntil polls f every pollEvery until it returns nil (the time it did) or d
// passes (fatal, with f's last error).
func pollUntil(ctx context.Context, t *testing.T, d time.Duration, what string, f func() error) time.Time {
	t.Helper()
	return testutil.PollUntil(ctx, t, d, pollEvery, what, f)
}

// getPod reads a pod.
func getPod(ctx context.Context, t *testing.T, tb *testbed.Testbed, ns, name string) *corev1.Pod {
	t.Helper()
	p, err := tb.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// meshedPath connects from the client's app to the server's app and checks both
// captures: on the client's node by its proxy on 15001, on the server's node by its
// proxy on 15006 (the connection the client's proxy made, UID 1337, exempt), each
// with the server's pod IP and app port as original destination. It returns the two
// records and what the client saw.
func meshedPath(ctx context.Context, t *testing.T, tb *testbed.Testbed, client, server *corev1.Pod) (out, in proxysim.Record, res proxysim.ProbeResult) {
	t.Helper()
	dst := podAddr(t, server, demo.AppPort)
	res = probeFrom(ctx, t, tb, client, demo.AppContainer, dst)
	out = connRecord(ctx, t, tb, client, proxysim.ListenerOutbound, res.Local)
	if out.Local.Port() != 15001 || out.OrigDst != dst || out.OrigDstErr != "" || out.ForwardErr != "" {
		t.Errorf("%s on %s: its proxy's record %+v; want local port 15001 and original destination %v, forwarded", client.Name, client.Spec.NodeName, out, dst)
	}
	in = connRecord(ctx, t, tb, server, proxysim.ListenerInbound, out.ForwardSource)
	if in.Local.Port() != 15006 || in.OrigDst != dst || in.OrigDstErr != "" || in.ForwardErr != "" {
		t.Errorf("%s on %s: its proxy's record %+v; want local port 15006 and original destination %v, forwarded", server.Name, server.Spec.NodeName, in, dst)
	}
	return out, in, res
}
