// Package demo is `make demo`: meshcni installed with its own Helm chart on the
// test bed's real single-node Kubernetes, and a small app showing the redirect.
//
// Run builds the meshcni image (pkg/images), imports it into the test bed's
// containerd, installs the chart (deploy/charts/meshcni, with
// deploy/testbed-values.yaml) with a Helm built from the module proxy (hack/helm),
// waits for the agent DaemonSet to be ready and for the plugin to be in the node's
// CNI configuration, then creates three pods in namespace meshcni-demo — a meshed
// one (Istio-style: sidecar.istio.io/status, an istio-validation init container
// running `meshcnictl validate` as UID 1337, the app, and an istio-proxy container
// running meshcni-proxysim as UID 1337), the same app without a sidecar, and a TCP
// server — sends traffic between them from inside the pods, and prints what
// happened: which pods were redirected, which connections the proxy saw with their
// original destinations (from its log), and the rules `meshcnictl inspect` reads
// from the meshed pod. Every line of the report is also a check; Run returns an
// error naming each one that failed.
package demo

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/standin/proxysim"
	"github.com/meshcni/meshcni/internal/tools/build/image"
)

// Helm release of meshcni.
const (
	Release          = "meshcni"
	ReleaseNamespace = "meshcni-system"
	// ChartDir and ValuesFile are relative to the repository root.
	ChartDir   = "deploy/charts/meshcni"
	ValuesFile = "deploy/testbed-values.yaml"
	// NotReadyTaint is the taint meshcni's taint controller keeps on a node whose
	// agent is not ready.
	NotReadyTaint = "cni.istio.io/not-ready"
	// imageAnnotation on the agent pods carries the image digest, so a rebuilt image
	// with the same tag rolls the DaemonSet.
	imageAnnotation = "demo.meshcni.io/image-digest"
)

// Options configure Run.
type Options struct {
	// RepoRoot is the module root (chart, values, hack/helm, go build).
	RepoRoot string
	// Hub and Tag of the image (image.DefaultHub, image.DefaultTag when empty).
	Hub, Tag string
	// Out receives the report; Log the progress.
	Out io.Writer
	Log *slog.Logger
	// Keep leaves meshcni and the demo app installed (make demo; make demo-down
	// removes them). When false, Run uninstalls both at the end and checks that the
	// agent removed the plugin from the node (the test).
	Keep bool
	// Timeout bounds each wait (2 minutes when zero).
	Timeout time.Duration
	// APIServerHost and APIServerPort are where meshcni's pods reach the API
	// server (testbed.APIServerHost and APIServerPort when empty; a test bed
	// with several nodes needs testbed.ClusterAPIServerHost).
	APIServerHost string
	APIServerPort int
	// Values are more Helm values files, given after ValuesFile.
	Values []string
}

// Report is what Run saw.
type Report struct {
	Image       *image.Result
	Steps       []Step
	Pods        []PodRow
	Connections []ConnRow
	Inspect     *InspectReport // of the meshed pod
	Failures    []string
}

// Step is one timed phase.
type Step struct {
	Name string
	Took time.Duration
}

// PodRow is one line of the pods table.
type PodRow struct {
	Pod        string
	IP         string
	Meshed     bool   // the plugin's decision, as inspect reports it
	Reason     string // why
	Rules      string // live rules: "<backend> (<status>)" or "none"
	Validation string // the istio-validation init container's result, "-" without one
	ProxyConns int    // connections the pod's proxy accepted, -1 without a proxy
}

// ConnRow is one line of the connections table.
type ConnRow struct {
	From, To   string // pod/container (uid) and pod:port
	Dst        netip.AddrPort
	Captured   string // "outbound :15001", "inbound :15006" or "no"
	OrigDst    string // original destination the proxy read, "-" when not captured
	SeenSource string // the client address the destination saw
	Reply      bool
	OK         bool
	want       string
}

func (o *Options) defaults() {
	if o.Hub == "" {
		o.Hub = image.DefaultHub
	}
	if o.Tag == "" {
		o.Tag = image.DefaultTag
	}
	if o.Out == nil {
		o.Out = os.Stdout
	}
	if o.Log == nil {
		o.Log = slog.Default()
	}
	if o.Timeout == 0 {
		o.Timeout = 2 * time.Minute
	}
	if o.APIServerHost == "" {
		o.APIServerHost = testbed.APIServerHost
	}
	if o.APIServerPort == 0 {
		o.APIServerPort = testbed.APIServerPort
	}
}

// runner carries the state of one Run.
type runner struct {
	o      Options
	tb     *testbed.Testbed
	rep    *Report
	helm   string
	hostCt string // host meshcnictl built with the image
	plugin string // host copy of the plugin in the image
	// proxysimRef is the stand-in proxy image the app and the istio-proxy run.
	proxysimRef string
	ips         map[string]netip.Addr
	// proxyConns counts the connections the meshed pod's proxy accepted.
	proxyConns int
	last       time.Time
}

func (r *runner) step(name string) {
	now := time.Now()
	r.rep.Steps = append(r.rep.Steps, Step{Name: name, Took: now.Sub(r.last)})
	r.o.Log.Info("demo: "+name, "took", now.Sub(r.last).Round(time.Millisecond))
	r.last = now
}

func (r *runner) fail(format string, args ...any) {
	r.rep.Failures = append(r.rep.Failures, fmt.Sprintf(format, args...))
}

// Run runs the demo on tb (a full-mode test bed) and prints the report to o.Out.
// The error lists every check that failed; the report is returned in any case once
// the app ran.
func Run(ctx context.Context, tb *testbed.Testbed, o Options) (*Report, error) {
	o.defaults()
	if tb.Mode != testbed.ModeFull {
		return nil, fmt.Errorf("demo: the test bed runs %s; the demo needs a full node (hack/testbed down; make demo)", tb.Mode)
	}
	r := &runner{o: o, tb: tb, rep: &Report{}, ips: map[string]netip.Addr{}, last: time.Now()}
	err := r.run(ctx)
	if !o.Keep {
		// Also after a failure: the test bed is shared by the tests that follow.
		if uerr := r.uninstall(context.WithoutCancel(ctx)); uerr != nil {
			r.fail("uninstall: %v", uerr)
		}
	}
	if err != nil {
		return r.rep, err
	}
	if len(r.rep.Failures) > 0 {
		return r.rep, fmt.Errorf("demo: %d check(s) failed:\n  - %s", len(r.rep.Failures), strings.Join(r.rep.Failures, "\n  - "))
	}
	return r.rep, nil
}

func (r *runner) run(ctx context.Context) error {
	if err := r.install(ctx); err != nil {
		return err
	}
	if err := r.app(ctx); err != nil {
		return err
	}
	r.traffic(ctx)
	r.inspect(ctx)
	r.step("report")
	Print(r.o.Out, r.rep)
	return nil
}

// install builds and imports the image and installs the chart.
func (r *runner) install(ctx context.Context) error {
	o := r.o
	work := filepath.Join(o.RepoRoot, "bin", "images", "build")
	img, err := image.Build(ctx, image.Options{
		RepoRoot: o.RepoRoot, Hub: o.Hub, Tag: o.Tag,
		Out: image.DefaultArchive(o.RepoRoot, o.Tag), WorkDir: work, Logger: o.Log,
	})
	if err != nil {
		return fmt.Errorf("build the image: %w", err)
	}
	r.rep.Image = img
	hostDir := HostBinDir(o.RepoRoot)
	r.hostCt = filepath.Join(hostDir, "meshcnictl")
	r.plugin = filepath.Join(hostDir, image.PluginCommand)
	r.step(fmt.Sprintf("image %s built (%.1f MB)", img.Ref, float64(img.ArchiveSize)/1e6))

	if err := testbed.ImportImage(ctx, img.Out); err != nil {
		return err
	}
	r.step("image imported into the test bed's containerd")

	// The stand-in sidecar proxy is a demo tool: its own image, not the product's.
	psArchive := image.ProxysimArchive(o.RepoRoot, o.Tag)
	if r.proxysimRef, err = image.BuildProxysim(ctx, o.RepoRoot, o.Hub, o.Tag, psArchive); err != nil {
		return fmt.Errorf("build the stand-in proxy's image: %w", err)
	}
	if err := testbed.ImportImage(ctx, psArchive); err != nil {
		return err
	}
	r.step("stand-in proxy image " + r.proxysimRef + " built and imported")

	if r.helm, err = helmPath(ctx, o.RepoRoot); err != nil {
		return err
	}
	args := []string{"upgrade", "--install", Release, filepath.Join(o.RepoRoot, ChartDir),
		"--namespace", ReleaseNamespace, "--create-namespace",
		"--values", filepath.Join(o.RepoRoot, ValuesFile),
	}
	for _, v := range o.Values {
		args = append(args, "--values", v)
	}
	args = append(args,
		"--set-string", "hub="+o.Hub, "--set-string", "tag="+o.Tag,
		"--set-string", "pullPolicy=Never",
		"--set-string", "cniBinDir="+testbed.CNIBinDir,
		"--set-string", "cniConfDir="+testbed.CNIConfDir,
		"--set-string", "apiServer.host="+o.APIServerHost,
		"--set", "apiServer.port="+strconv.Itoa(o.APIServerPort),
		"--set", "taintController.enabled=true",
		"--set-string", "podAnnotations."+strings.ReplaceAll(imageAnnotation, ".", `\.`)+"="+img.IndexDigest,
	)
	if _, err := r.runHelm(ctx, args...); err != nil {
		return err
	}
	r.step("helm upgrade --install " + Release + " " + ChartDir)

	wctx, cancel := context.WithTimeout(ctx, o.Timeout)
	defer cancel()
	ds, err := r.agentDaemonSet(wctx)
	if err != nil {
		return err
	}
	if _, err := r.tb.WaitDaemonSet(wctx, ReleaseNamespace, ds); err != nil {
		return fmt.Errorf("%w\n%s", err, r.agentDiagnosis(ctx))
	}
	r.step("agent DaemonSet " + ReleaseNamespace + "/" + ds + " ready")
	if err := r.waitPlugin(wctx); err != nil {
		return fmt.Errorf("%w\n%s", err, r.agentDiagnosis(ctx))
	}
	r.step("plugin installed by the agent into " + testbed.CNIBinDir + " and " + testbed.DefaultConflistName)
	if err := r.waitUntainted(wctx); err != nil {
		return err
	}
	r.step("node free of the " + NotReadyTaint + " taint")
	return nil
}

// HostBinDir is where Run and Install leave the host's build of the image's
// commands (meshcnictl, the plugin, …).
func HostBinDir(repoRoot string) string {
	return filepath.Join(repoRoot, "bin", "images", "build", strings.ReplaceAll(image.HostArch().String(), "/", "-"))
}

func helmPath(ctx context.Context, root string) (string, error) {
	if p := os.Getenv("MESHCNI_HELM"); p != "" {
		return p, nil
	}
	cmd := exec.CommandContext(ctx, "bash", filepath.Join(root, "hack", "helm"), "--path")
	cmd.Dir = root
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("hack/helm --path: %w: %s", err, strings.TrimSpace(stderr.String()))
	}
	return strings.TrimSpace(string(out)), nil
}

func (r *runner) runHelm(ctx context.Context, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, r.helm, args...)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+testbed.KubeconfigPath())
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("helm %s: %w: %s", args[0], err, strings.TrimSpace(string(out)))
	}
	return string(out), nil
}

// agentDaemonSet finds the release's DaemonSet (one per release).
func (r *runner) agentDaemonSet(ctx context.Context) (string, error) {
	l, err := r.tb.Client.AppsV1().DaemonSets(ReleaseNamespace).List(ctx, metav1.ListOptions{
		LabelSelector: "app.kubernetes.io/instance=" + Release,
	})
	if err != nil {
		return "", fmt.Errorf("list DaemonSets of release %s: %w", Release, err)
	}
	if len(l.Items) != 1 {
		return "", fmt.Errorf("release %s has %d DaemonSets, want 1", Release, len(l.Items))
	}
	return l.Items[0].Name, nil
}

// agentDiagnosis is the agent pods' state and log tails, for a failed wait.
func (r *runner) agentDiagnosis(ctx context.Context) string {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	pods, err := r.tb.Client.CoreV1().Pods(ReleaseNamespace).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/instance=" + Release})
	if err != nil {
		return err.Error()
	}
	var b strings.Builder
	for _, p := range pods.Items {
		fmt.Fprintf(&b, "pod %s: phase %s\n", p.Name, p.Status.Phase)
		for _, cs := range p.Status.ContainerStatuses {
			fmt.Fprintf(&b, "  %s ready=%v restarts=%d state=%+v\n", cs.Name, cs.Ready, cs.RestartCount, cs.State)
			if logs, err := r.tb.PodLogs(ctx, p.Namespace, p.Name, cs.Name); err == nil {
				fmt.Fprintf(&b, "  last log lines:\n%s\n", tailLines(logs, 15))
			}
		}
	}
	return b.String()
}

func tailLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return "    " + strings.Join(lines, "\n    ")
}

func fileSHA(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("%x", sha256.Sum256(b)), nil
}

// pluginState says whether the node has the plugin of the image: the binary in the
// CNI bin dir and an entry in the primary configuration.
func pluginState(wantSHA string) (binary, entry bool, err error) {
	got, err := fileSHA(filepath.Join(testbed.CNIBinDir, image.PluginCommand))
	binary = err == nil && (wantSHA == "" || got == wantSHA)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return false, false, err
	}
	b, err := os.ReadFile(filepath.Join(testbed.CNIConfDir, testbed.DefaultConflistName))
	if err != nil {
		return binary, false, err
	}
	var conf struct {
		Plugins []struct {
			Type string `json:"type"`
		} `json:"plugins"`
	}
	if err := json.Unmarshal(b, &conf); err != nil {
		return binary, false, fmt.Errorf("parse %s: %w", testbed.DefaultConflistName, err)
	}
	for _, p := range conf.Plugins {
		if p.Type == image.PluginCommand {
			entry = true
		}
	}
	return binary, entry, nil
}

func (r *runner) waitPlugin(ctx context.Context) error {
	want, err := fileSHA(r.plugin)
	if err != nil {
		return err
	}
	var bin, entry bool
	for {
		bin, entry, err = pluginState(want)
		if bin && entry {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("the agent did not install the plugin (binary from the image: %v, entry in %s: %v, last error: %v)",
				bin, testbed.DefaultConflistName, entry, err)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func (r *runner) waitUntainted(ctx context.Context) error {
	for {
		n, err := r.tb.Client.CoreV1().Nodes().Get(ctx, testbed.NodeName, metav1.GetOptions{})
		if err == nil && !slices.ContainsFunc(n.Spec.Taints, func(t corev1.Taint) bool { return t.Key == NotReadyTaint }) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("node %s still has taint %s (err %v): is the taint controller running?", testbed.NodeName, NotReadyTaint, err)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// app (re)creates the demo namespace and its pods and waits until they serve.
func (r *runner) app(ctx context.Context) error {
	wctx, cancel := context.WithTimeout(ctx, r.o.Timeout)
	defer cancel()
	if err := deleteNamespace(wctx, r.tb, Namespace); err != nil {
		return err
	}
	if err := r.tb.CreateNamespace(wctx, Namespace); err != nil {
		return err
	}
	pods := Pods(r.o.Hub+"/"+image.Name+":"+r.o.Tag, r.proxysimRef)
	for _, p := range pods {
		if _, err := r.tb.CreatePod(wctx, p); err != nil {
			return err
		}
	}
	for _, p := range pods {
		got, err := r.tb.WaitPodReady(wctx, Namespace, p.Name)
		if err != nil {
			return err
		}
		ip, err := netip.ParseAddr(got.Status.PodIP)
		if err != nil {
			return fmt.Errorf("pod %s IP %q: %w", p.Name, got.Status.PodIP, err)
		}
		r.ips[p.Name] = ip
	}
	// The listeners are bound once each proxysim printed its ready record.
	for _, pc := range [][2]string{{MeshedPod, ProxyContainer}, {MeshedPod, AppContainer}, {PlainPod, AppContainer}} {
		if err := r.waitReadyRecord(wctx, pc[0], pc[1]); err != nil {
			return err
		}
	}
	r.step(fmt.Sprintf("demo pods ready in namespace %s", Namespace))
	// The image's CLI runs in a pod as a non-root UID: the meshed pod's validation
	// init container is meshcnictl from the meshcni image, run as the proxy's UID.
	meshed, err := r.tb.Client.CoreV1().Pods(Namespace).Get(wctx, MeshedPod, metav1.GetOptions{})
	if err != nil {
		return err
	}
	ran := false
	for _, st := range meshed.Status.InitContainerStatuses {
		if st.Name == ValidationContainer && st.State.Terminated != nil && st.State.Terminated.ExitCode == 0 {
			ran = true
		}
	}
	if !ran {
		r.fail("%s validate in pod %s (init container %s) did not exit 0: %+v", meshcnictlPath, MeshedPod, ValidationContainer, meshed.Status.InitContainerStatuses)
	}
	return nil
}

// deleteNamespace deletes a namespace and waits until it is gone (a Terminating
// namespace refuses new objects).
func deleteNamespace(ctx context.Context, tb *testbed.Testbed, name string) error {
	err := tb.Client.CoreV1().Namespaces().Delete(ctx, name, metav1.DeleteOptions{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("delete namespace %s: %w", name, err)
	}
	for {
		_, err := tb.Client.CoreV1().Namespaces().Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("namespace %s not gone: %w", name, ctx.Err())
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func (r *runner) waitReadyRecord(ctx context.Context, pod, container string) error {
	for {
		logs, err := r.tb.PodLogs(ctx, Namespace, pod, container)
		if err == nil {
			for _, rec := range parseRecords(logs) {
				if rec.Event == proxysim.EventReady {
					return nil
				}
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s/%s: no ready record in its log (err %v):\n%s", pod, container, err, tailLines(logs, 10))
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// parseRecords reads proxysim's JSON records from a container log (stdout and
// stderr interleaved: lines that are not records are skipped).
func parseRecords(logs string) []proxysim.Record {
	var out []proxysim.Record
	for line := range strings.SplitSeq(logs, "\n") {
		line = strings.TrimSpace(line)
		if !strings.HasPrefix(line, "{") || !strings.Contains(line, `"event"`) {
			continue
		}
		var rec proxysim.Record
		if json.Unmarshal([]byte(line), &rec) == nil && rec.Event != "" {
			out = append(out, rec)
		}
	}
	return out
}

// probe is one connection of the demo.
type probe struct {
	fromPod, fromContainer string
	uid                    int
	toPod                  string
	port                   uint16
	// want is the meshed proxy's listener that must capture it ("" = none).
	want string
	// wantSource is the source address the destination must see: a pod's IP, or
	// 127.0.0.6 (the proxy's inbound passthrough).
	wantSource string
}

// Probes are the demo's connections.
func probes() []probe {
	return []probe{
		{MeshedPod, AppContainer, AppUID, ServerPod, testbed.EchoPort, proxysim.ListenerOutbound, MeshedPod},
		{MeshedPod, AppContainer, AppUID, PlainPod, AppPort, proxysim.ListenerOutbound, MeshedPod},
		{MeshedPod, ProxyContainer, ProxyUID, ServerPod, testbed.EchoPort, "", MeshedPod},
		{PlainPod, AppContainer, AppUID, MeshedPod, AppPort, proxysim.ListenerInbound, "127.0.0.6"},
		{PlainPod, AppContainer, AppUID, ServerPod, testbed.EchoPort, "", PlainPod},
	}
}

// sent is one probe made: its destination and what the client saw.
type sent struct {
	p   probe
	dst netip.AddrPort
	res proxysim.ProbeResult
	err error
}

func (r *runner) traffic(ctx context.Context) {
	var all []sent
	for _, p := range probes() {
		dst := netip.AddrPortFrom(r.ips[p.toPod], p.port)
		s := sent{p: p, dst: dst}
		stdout, stderr, err := r.tb.Exec(ctx, Namespace, p.fromPod, p.fromContainer,
			proxysimPath, "client", "--connect", dst.String(), "--send", "hello from "+p.fromPod+"\n", "--timeout", "5s")
		if err != nil {
			s.err = fmt.Errorf("exec: %w: %s", err, strings.TrimSpace(stderr))
		} else if err := json.Unmarshal([]byte(stdout), &s.res); err != nil {
			s.err = fmt.Errorf("probe output %q: %w", stdout, err)
		}
		all = append(all, s)
	}
	proxyLogs, err := r.tb.PodLogs(ctx, Namespace, MeshedPod, ProxyContainer)
	if err != nil {
		r.fail("proxy log: %v", err)
	}
	records := parseRecords(proxyLogs)
	for _, rec := range records {
		if rec.Event == proxysim.EventConn {
			r.proxyConns++
		}
	}
	for _, s := range all {
		row, problems := judge(s, records, r.ips)
		if len(problems) > 0 {
			r.fail("%s → %s: %s", row.From, row.To, strings.Join(problems, "; "))
		}
		r.rep.Connections = append(r.rep.Connections, row)
	}
	r.step(fmt.Sprintf("%d connections made from inside the pods", len(all)))
}

// judge builds a connection's row from what the client saw, the proxy's records and
// the destination's answer, and lists every way it differs from the probe's
// expectation: captured by the right listener (or not at all), the original
// destination equal to the address dialled, an answer from the destination, and the
// source the destination saw.
func judge(s sent, records []proxysim.Record, ips map[string]netip.Addr) (ConnRow, []string) {
	p := s.p
	row := ConnRow{
		From: fmt.Sprintf("%s/%s (uid %d)", p.fromPod, p.fromContainer, p.uid),
		To:   fmt.Sprintf("%s %s", p.toPod, s.dst),
		Dst:  s.dst, Captured: "no", OrigDst: "-", SeenSource: "-",
		want: "not captured",
	}
	if p.want != "" {
		row.want = "captured on " + p.want
	}
	var rec *proxysim.Record
	for i := range records {
		if records[i].Event == proxysim.EventConn && s.res.Local.IsValid() && records[i].Peer == s.res.Local {
			rec = &records[i]
		}
	}
	if rec != nil {
		row.Captured = fmt.Sprintf("%s :%d", rec.Listener, rec.Local.Port())
		row.OrigDst = rec.OrigDst.String()
		if rec.OrigDstErr != "" {
			row.OrigDst = "error: " + rec.OrigDstErr
		}
	}
	if s.err == nil && s.res.Connected {
		if seen := seenSource(p.toPod, s.res.Reply); seen.IsValid() {
			row.Reply = true
			row.SeenSource = seen.Addr().String()
		}
	}
	wantSrc := p.wantSource
	if ip, ok := ips[wantSrc]; ok {
		wantSrc = ip.String()
	}
	var problems []string
	switch {
	case s.err != nil:
		problems = append(problems, s.err.Error())
	case !s.res.Connected:
		problems = append(problems, "not connected: "+s.res.Error)
	case !row.Reply:
		problems = append(problems, fmt.Sprintf("no answer from %s (reply %q)", p.toPod, s.res.Reply))
	}
	if p.want == "" && rec != nil {
		problems = append(problems, fmt.Sprintf("the proxy captured it (%s), but it must not be redirected", row.Captured))
	}
	if p.want != "" {
		switch {
		case rec == nil:
			problems = append(problems, "the proxy did not see it")
		case rec.Listener != p.want:
			problems = append(problems, "captured by the "+rec.Listener+" listener, want "+p.want)
		case rec.OrigDst != s.dst:
			problems = append(problems, fmt.Sprintf("original destination %s, want %s", row.OrigDst, s.dst))
		case rec.ForwardErr != "":
			problems = append(problems, "forward failed: "+rec.ForwardErr)
		}
	}
	if row.Reply && row.SeenSource != wantSrc {
		problems = append(problems, fmt.Sprintf("%s saw the connection from %s, want %s", p.toPod, row.SeenSource, wantSrc))
	}
	row.OK = len(problems) == 0
	return row, problems
}

// seenSource is the client address the destination reported: the echo server
// answers "<hostname> <remote addr>", the app one JSON record with the peer.
func seenSource(toPod, reply string) netip.AddrPort {
	first, _, _ := strings.Cut(reply, "\n")
	if toPod == ServerPod {
		f := strings.Fields(first)
		if len(f) == 2 {
			if ap, err := netip.ParseAddrPort(f[1]); err == nil {
				return ap
			}
		}
		return netip.AddrPort{}
	}
	var rec proxysim.Record
	if json.Unmarshal([]byte(first), &rec) != nil {
		return netip.AddrPort{}
	}
	return rec.Peer
}
