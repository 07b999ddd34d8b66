// Package multinode is meshcni installed with its own Helm chart across the test
// bed's real nodes (internal/env/testbed with several nodes), and what the proofs of
// the cluster-wide behaviour need around it: per-node waits (agent Ready, plugin in
// that node's CNI configuration, node untainted), helm upgrade and uninstall, the
// agent pod and its metrics on a node, a meshed pod pinned to a node and the audit
// of a pod from its own node (Redirected).
//
// The install is demo.Install's (the image, the stand-in proxy's image, the chart
// with deploy/testbed-values.yaml) with the multi-node differences in one values
// file: the API server at testbed.ClusterAPIServerHost, which every node reaches;
// the agent's runDir inside testbed.RunDir, each node's own tmpfs (the chart's
// /var/run/meshcni is on the host's file system, one directory for every node's
// agent); the taint controller on node 1, so a node a test removes or kills never
// takes it along, and on the pod network (it reaches the API server at the
// cluster address; a host-network replica would hold its port on node 1 and
// block the surge pod of a rolling update); and nodes labelled UnmeshedLabel left
// alone (no agent, no taint), the baseline of BenchmarkNodeJoin.
package multinode

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/internal/env/demo"
	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/testkit/reporoot"
	"github.com/meshcni/meshcni/internal/tools/build/image"
)

const (
	// AgentRunDir is the agent's runDir (its socket) on every node: inside
	// testbed.RunDir, which is each node's own tmpfs.
	AgentRunDir = testbed.RunDir + "/meshcni"
	// UnmeshedLabel on a node (any value, set at registration:
	// testbed.NodeOptions.Labels) keeps meshcni off it: no agent pod, never tainted.
	UnmeshedLabel = "multinode.meshcni.io/unmeshed"
	// MetricsPort is the agent's health and metrics port (the chart's
	// metrics.port), on the node's IP.
	MetricsPort = 9807
	// AgentSelector selects the release's agent pods.
	AgentSelector = "app.kubernetes.io/instance=" + demo.Release + ",app.kubernetes.io/component=agent"
)

// values are the multi-node differences from deploy/testbed-values.yaml.
var values = `runDir: ` + AgentRunDir + `
affinity:
  nodeAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      nodeSelectorTerms:
        - matchExpressions:
            - {key: ` + UnmeshedLabel + `, operator: DoesNotExist}
audit:
  period: 10s
taintController:
  hostNetwork: false
  nodeSelectorLabels: "kubernetes.io/os=linux,!` + UnmeshedLabel + `"
  nodeSelector:
    kubernetes.io/hostname: ` + testbed.NodeName + `
`

// Options configure Install.
type Options struct {
	// RepoRoot is the module root (reporoot.Find() when empty).
	RepoRoot string
	// Hub and Tag of the image (image.DefaultHub, image.DefaultTag when empty).
	Hub, Tag string
	// Log receives progress (slog.Default() when nil).
	Log *slog.Logger
	// Timeout bounds each wait (2 minutes when zero).
	Timeout time.Duration
}

// Cluster is meshcni installed on a test bed's nodes.
type Cluster struct {
	TB *testbed.Testbed
	// Image is the meshcni image installed; MeshcniImage its reference (the
	// meshed pods' istio-validation init container runs it) and ProxyImage the
	// stand-in proxy's (their app and istio-proxy containers).
	Image        *image.Result
	MeshcniImage string
	ProxyImage   string
	// Meshcnictl is the host's meshcnictl of the same build (Redirected runs it).
	Meshcnictl string

	o         Options
	helm      string
	valuesDir string
	pluginSHA string
}

func (o *Options) defaults() error {
	if o.RepoRoot == "" {
		root, err := reporoot.Find()
		if err != nil {
			return err
		}
		o.RepoRoot = root
	}
	if o.Hub == "" {
		o.Hub = image.DefaultHub
	}
	if o.Tag == "" {
		o.Tag = image.DefaultTag
	}
	if o.Log == nil {
		o.Log = slog.Default()
	}
	if o.Timeout == 0 {
		o.Timeout = 2 * time.Minute
	}
	return nil
}

// Install builds and imports the meshcni image and the stand-in proxy's image
// (into every node), helm installs deploy/charts/meshcni (taint controller on, the
// API server at testbed.ClusterAPIServerHost) and returns once every node without
// UnmeshedLabel is meshed (WaitNodeMeshed).
func Install(ctx context.Context, tb *testbed.Testbed, o Options) (*Cluster, error) {
	if err := o.defaults(); err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "meshcni-multinode-")
	if err != nil {
		return nil, err
	}
	vf := filepath.Join(dir, "multinode-values.yaml")
	if err := os.WriteFile(vf, []byte(values), 0o644); err != nil {
		return nil, err
	}
	img, err := demo.Install(ctx, tb, demo.Options{
		RepoRoot: o.RepoRoot, Hub: o.Hub, Tag: o.Tag, Out: io.Discard, Log: o.Log, Timeout: o.Timeout,
		APIServerHost: testbed.ClusterAPIServerHost, APIServerPort: testbed.APIServerPort, Values: []string{vf},
	})
	if err != nil {
		return nil, fmt.Errorf("install meshcni: %w", err)
	}
	c := &Cluster{TB: tb, Image: img, MeshcniImage: img.Ref, o: o, valuesDir: dir,
		Meshcnictl: filepath.Join(demo.HostBinDir(o.RepoRoot), "meshcnictl")}
	if c.ProxyImage, err = image.ProxysimRef(o.Hub, o.Tag); err != nil {
		return nil, err
	}
	if c.pluginSHA, err = fileSHA(filepath.Join(demo.HostBinDir(o.RepoRoot), image.PluginCommand)); err != nil {
		return nil, err
	}
	if c.helm, err = demo.HelmPath(ctx, o.RepoRoot); err != nil {
		return nil, err
	}
	wctx, cancel := context.WithTimeout(ctx, o.Timeout)
	defer cancel()
	if err := c.WaitMeshed(wctx); err != nil {
		return c, err
	}
	return c, nil
}

// MeshedNodes are the test bed's nodes meshcni runs on (those without UnmeshedLabel).
func (c *Cluster) MeshedNodes(ctx context.Context) ([]*testbed.Node, error) {
	var out []*testbed.Node
	for _, n := range c.TB.Nodes() {
		obj, err := c.TB.Client.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
		if err != nil {
			return nil, fmt.Errorf("node %s: %w", n.Name, err)
		}
		if _, ok := obj.Labels[UnmeshedLabel]; !ok {
			out = append(out, n)
		}
	}
	return out, nil
}

// WaitMeshed runs WaitNodeMeshed for every meshed node at once.
func (c *Cluster) WaitMeshed(ctx context.Context) error {
	nodes, err := c.MeshedNodes(ctx)
	if err != nil {
		return err
	}
	errs := make([]error, len(nodes))
	var wg sync.WaitGroup
	for i, n := range nodes {
		wg.Go(func() { errs[i] = c.WaitNodeMeshed(ctx, n) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

// NodeMeshed says whether meshcni is in place on the node: its agent pod Ready,
// the plugin binary of the installed build in the node's CNI bin directory,
// exactly one meshcni entry in its primary conflist, and no NotReadyTaint. The
// error says what is missing.
func (c *Cluster) NodeMeshed(ctx context.Context, n *testbed.Node) error {
	var missing []string
	if p, err := c.AgentPod(ctx, n.Name); err != nil {
		missing = append(missing, err.Error())
	} else if !PodReady(p) {
		missing = append(missing, "agent pod "+p.Name+" not Ready")
	}
	st := c.Plugin(n)
	if !st.Binary {
		missing = append(missing, "plugin binary of this build not in "+n.CNIBinDir())
	}
	if st.Err != nil || st.Entries != 1 {
		missing = append(missing, st.String())
	}
	node, err := c.TB.Client.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
	if err != nil {
		missing = append(missing, err.Error())
	} else if HasTaint(node, demo.NotReadyTaint) {
		missing = append(missing, "taint "+demo.NotReadyTaint+" still on the node")
	}
	if len(missing) > 0 {
		return fmt.Errorf("node %s: %s", n.Name, strings.Join(missing, "; "))
	}
	return nil
}

// WaitNodeMeshed waits until NodeMeshed is true for the node (polling every
// 100 ms); the error carries the last state and the agent's log tail.
func (c *Cluster) WaitNodeMeshed(ctx context.Context, n *testbed.Node) error {
	var last error
	for {
		if last = c.NodeMeshed(ctx, n); last == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("meshcni not in place: %w\n%s", last, c.agentLog(n.Name))
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// HasTaint reports whether the node carries a NoSchedule taint with key.
func HasTaint(n *corev1.Node, key string) bool {
	return slices.ContainsFunc(n.Spec.Taints, func(t corev1.Taint) bool {
		return t.Key == key && t.Effect == corev1.TaintEffectNoSchedule
	})
}

// PodReady reports a pod Running with condition Ready True and not being deleted.
func PodReady(p *corev1.Pod) bool {
	if p.DeletionTimestamp != nil || p.Status.Phase != corev1.PodRunning {
		return false
	}
	for _, cd := range p.Status.Conditions {
		if cd.Type == corev1.PodReady {
			return cd.Status == corev1.ConditionTrue
		}
	}
	return false
}

// AgentPods are the release's agent pods on node (terminating ones included).
func (c *Cluster) AgentPods(ctx context.Context, node string) ([]corev1.Pod, error) {
	l, err := c.TB.Client.CoreV1().Pods(demo.ReleaseNamespace).List(ctx, metav1.ListOptions{
		LabelSelector: AgentSelector, FieldSelector: "spec.nodeName=" + node,
	})
	if err != nil {
		return nil, fmt.Errorf("agent pods on %s: %w", node, err)
	}
	return l.Items, nil
}

// AgentPod is the agent pod on node: a Ready one, else the newest not being
// deleted; an error when there is none.
func (c *Cluster) AgentPod(ctx context.Context, node string) (*corev1.Pod, error) {
	pods, err := c.AgentPods(ctx, node)
	if err != nil {
		return nil, err
	}
	var best *corev1.Pod
	for i := range pods {
		p := &pods[i]
		if PodReady(p) {
			return p, nil
		}
		if p.DeletionTimestamp == nil && (best == nil || p.CreationTimestamp.After(best.CreationTimestamp.Time)) {
			best = p
		}
	}
	if best == nil {
		return nil, fmt.Errorf("no meshcni agent pod on node %s", node)
	}
	return best, nil
}

// AgentMetrics is the Prometheus text of the node's agent (/metrics on the node's
// IP, where the chart's metrics.bindAddress hostIP puts it).
func (c *Cluster) AgentMetrics(ctx context.Context, node string) (string, error) {
	n, err := c.TB.Node(node)
	if err != nil {
		return "", err
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	url := fmt.Sprintf("http://%s:%d/metrics", n.IP, MetricsPort)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return "", err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", fmt.Errorf("agent metrics of %s: %w", node, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("agent metrics of %s: %s %v", url, resp.Status, err)
	}
	return string(b), nil
}

// agentLog is the node's agent pods' state and log tail, for a failed wait.
func (c *Cluster) agentLog(node string) string {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pods, err := c.AgentPods(ctx, node)
	if err != nil {
		return err.Error()
	}
	var b strings.Builder
	for _, p := range pods {
		fmt.Fprintf(&b, "agent pod %s on %s: phase %s ready %v\n", p.Name, node, p.Status.Phase, PodReady(&p))
		if logs, err := c.TB.PodLogs(ctx, p.Namespace, p.Name, ""); err == nil {
			lines := strings.Split(strings.TrimRight(logs, "\n"), "\n")
			fmt.Fprintf(&b, "  %s\n", strings.Join(lines[max(0, len(lines)-15):], "\n  "))
		}
	}
	return b.String()
}

// helmRun runs the cluster's Helm against the test bed.
func (c *Cluster) helmRun(ctx context.Context, args ...string) error {
	cmd := exec.CommandContext(ctx, c.helm, args...)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+testbed.KubeconfigPath())
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("helm %s: %w: %s", args[0], err, strings.TrimSpace(string(out)))
	}
	return nil
}

// Upgrade runs `helm upgrade --reuse-values` of the release with the chart of the
// repository and extra arguments (e.g. "--set-string", "tag=v2"), and returns once
// the agent DaemonSet is rolled out and every meshed node is meshed again.
func (c *Cluster) Upgrade(ctx context.Context, args ...string) error {
	base := []string{"upgrade", demo.Release, filepath.Join(c.o.RepoRoot, demo.ChartDir),
		"--namespace", demo.ReleaseNamespace, "--reuse-values"}
	if err := c.helmRun(ctx, append(base, args...)...); err != nil {
		return err
	}
	wctx, cancel := context.WithTimeout(ctx, c.o.Timeout)
	defer cancel()
	if err := c.WaitRolledOut(wctx); err != nil {
		return err
	}
	return c.WaitMeshed(wctx)
}

// WaitRolledOut waits until the agent DaemonSet's pods are all of its current
// template and available.
func (c *Cluster) WaitRolledOut(ctx context.Context) error {
	l, err := c.TB.Client.AppsV1().DaemonSets(demo.ReleaseNamespace).List(ctx, metav1.ListOptions{
		LabelSelector: "app.kubernetes.io/instance=" + demo.Release})
	if err != nil {
		return err
	}
	if len(l.Items) != 1 {
		return fmt.Errorf("release %s has %d DaemonSets, want 1", demo.Release, len(l.Items))
	}
	_, err = c.TB.WaitDaemonSet(ctx, demo.ReleaseNamespace, l.Items[0].Name)
	return err
}

// BuildTag makes the installed build's image under another tag (same binaries,
// nothing recompiled) and imports it into every node; it returns its reference.
func (c *Cluster) BuildTag(ctx context.Context, tag string) (string, error) {
	ref, err := image.Ref(c.o.Hub, tag)
	if err != nil {
		return "", err
	}
	cmds, err := image.Commands(ctx, c.o.RepoRoot)
	if err != nil {
		return "", err
	}
	bins := map[string]string{}
	for _, cmd := range cmds {
		bins[cmd] = filepath.Join(demo.HostBinDir(c.o.RepoRoot), cmd)
	}
	out := image.DefaultArchive(c.o.RepoRoot, tag)
	res, err := image.Assemble(ctx, image.AssembleOptions{Ref: ref, Tag: tag,
		Version: c.Image.Version, Revision: c.Image.Revision, Arches: []image.Arch{image.HostArch()},
		Binaries: map[image.Arch]map[string]string{image.HostArch(): bins}, Out: out})
	if err != nil {
		return "", fmt.Errorf("image %s: %w", ref, err)
	}
	if err := testbed.ImportImage(ctx, res.Out); err != nil {
		return "", err
	}
	return ref, nil
}

// Uninstall removes the release (demo.Down: helm uninstall, the agent takes the
// plugin out of node 1) and waits until no node has the plugin binary or a
// meshcni entry in its conflist.
func (c *Cluster) Uninstall(ctx context.Context) error {
	defer os.RemoveAll(c.valuesDir)
	if err := demo.Down(ctx, c.TB, c.o.RepoRoot, c.helm, c.o.Timeout); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, c.o.Timeout)
	defer cancel()
	for _, n := range c.TB.Nodes() {
		for {
			st := c.Plugin(n)
			if st.Err == nil && !st.AnyBinary && st.Entries == 0 {
				break
			}
			select {
			case <-ctx.Done():
				return fmt.Errorf("after helm uninstall node %s still has the plugin (%s, binary %v)", n.Name, st, st.AnyBinary)
			case <-time.After(100 * time.Millisecond):
			}
		}
	}
	return nil
}
