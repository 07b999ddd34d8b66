// Package agenttest runs the real meshcni-agent binary as a host process wired to the
// test bed (internal/env/testbed): its CNI configuration and plugin directories, its admin
// kubeconfig (the agent's own API client and the plugin's kubeconfig source) and its
// node name. Tests get a handle with the health and metrics URLs, the agent's PID and
// log, and Stop (SIGTERM, exit code 0 asserted).
//
// When the test ends the agent is stopped and the CNI configuration directory is
// compared with what it held before Start: an agent stopped without --keep-on-exit
// must have put it back (its entry removed). Whatever the outcome, the directory and a
// meshcni binary that was in the plugin directory before are restored, so tests sharing
// the test bed see it as they left it.
//
//	func TestMain(m *testing.M) {
//		code := testbed.RunMain(m)
//		agenttest.RemoveBinaries()
//		os.Exit(code)
//	}
//
//	a := agenttest.Start(t, agenttest.Options{})  // waits for /readyz 200
//	fams := a.Metrics(t)
//	a.Stop()                                      // uninstalls; exit 0 asserted
package agenttest

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/fileutil"
	"github.com/meshcni/meshcni/pkg/podget"
)

// Binary names in the directory Binaries returns.
const (
	AgentBinary  = "meshcni-agent"
	PluginBinary = "meshcni"
)

var (
	buildOnce sync.Once
	buildDir  string
	buildErr  error
)

// Binaries builds ./cmd/meshcni-agent, ./cmd/meshcni and its API helper
// ./cmd/meshcni-podget (CGO_ENABLED=0, -trimpath)
// once per test binary and returns their directory. RemoveBinaries deletes it.
func Binaries(t testing.TB) string {
	t.Helper()
	gobin := testutil.RequireBinary(t, "go")
	buildOnce.Do(func() {
		root, err := testutil.RepoRoot()
		if err != nil {
			buildErr = err
			return
		}
		if buildDir, buildErr = os.MkdirTemp("", "meshcni-agenttest-bin-"); buildErr != nil {
			return
		}
		for name, pkg := range map[string]string{AgentBinary: "./cmd/meshcni-agent", PluginBinary: "./cmd/meshcni", podget.HelperName: "./cmd/meshcni-podget"} {
			cmd := exec.Command(gobin, "build", "-trimpath", "-o", filepath.Join(buildDir, name), pkg)
			cmd.Dir = root
			cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
			if out, err := cmd.CombinedOutput(); err != nil {
				buildErr = fmt.Errorf("go build %s: %w\n%s", pkg, err, out)
				return
			}
		}
	})
	if buildErr != nil {
		t.Fatalf("agenttest: %v", buildErr)
	}
	return buildDir
}

// RemoveBinaries deletes what Binaries built; call it from TestMain after the tests.
func RemoveBinaries() {
	if buildDir != "" {
		os.RemoveAll(buildDir)
	}
}

// Options say how to run the agent. The zero value runs it on the test bed's node
// with API access, into the test bed's CNI directories.
type Options struct {
	// ConfDir and BinDir default to testbed.CNIConfDir and testbed.CNIBinDir.
	ConfDir, BinDir string
	// PluginBinary is --plugin-binary; default the freshly built meshcni.
	PluginBinary string
	// Kubeconfig is --kubeconfig (the agent's API client) and --kubeconfig-source
	// (copied for the plugin); default testbed.KubeconfigPath().
	Kubeconfig string
	// NoKubeconfig runs the agent without --kubeconfig, so without API access (no
	// Events, no pod informer). The plugin still gets the test bed's kubeconfig.
	NoKubeconfig bool
	// NodeName is --node-name; default testbed.NodeName. "-" leaves it unset.
	NodeName string
	// PodName and PodNamespace are --pod-name and --pod-namespace (Events), if set.
	PodName, PodNamespace string
	// Args are appended to the command line (they win over the flags above).
	Args []string
	// NoWaitReady returns once /healthz answers, without waiting for /readyz 200.
	NoWaitReady bool
	// Timeout bounds the wait for the agent's health endpoints; 30 s when zero.
	Timeout time.Duration
}

// Agent is a running meshcni-agent process.
type Agent struct {
	// HealthURL, ReadyURL and MetricsURL are http://127.0.0.1:PORT/{healthz,readyz,metrics}.
	HealthURL, ReadyURL, MetricsURL string
	// RunDir is --run-dir (kubeconfig, agent.sock); ConfDir, BinDir the CNI directories.
	RunDir, ConfDir, BinDir string
	// LogPath is the agent's stderr (JSON lines).
	LogPath string
	// PID is the agent's process ID.
	PID int

	t        testing.TB
	cmd      *exec.Cmd
	done     chan struct{}
	waitErr  error
	stopOnce sync.Once
	stopErr  error
	keep     bool
}

// Start builds (once) and starts meshcni-agent, waits for /healthz and, unless
// NoWaitReady, for /readyz 200. The agent is stopped and the CNI directories
// restored when the test ends (see the package documentation).
func Start(t testing.TB, o Options) *Agent {
	t.Helper()
	bins := Binaries(t)
	if o.Kubeconfig == "" {
		o.Kubeconfig = testbed.KubeconfigPath()
	}
	if o.ConfDir == "" {
		o.ConfDir = testbed.CNIConfDir
	}
	if o.BinDir == "" {
		o.BinDir = testbed.CNIBinDir
	}
	if o.PluginBinary == "" {
		o.PluginBinary = filepath.Join(bins, PluginBinary)
	}
	if o.NodeName == "" {
		o.NodeName = testbed.NodeName
	}
	if o.Timeout == 0 {
		o.Timeout = 30 * time.Second
	}
	// A short path: the agent socket's must fit in a sockaddr_un (108 bytes).
	runDir, err := os.MkdirTemp("", "mcni-agent-")
	if err != nil {
		t.Fatal(err)
	}
	logDir := t.TempDir()
	a := &Agent{
		RunDir: runDir, ConfDir: o.ConfDir, BinDir: o.BinDir,
		LogPath: filepath.Join(logDir, "meshcni-agent.log"),
		t:       t, done: make(chan struct{}),
	}
	args := []string{
		"--cni-conf-dir", o.ConfDir,
		"--cni-bin-dir", o.BinDir,
		"--plugin-binary", o.PluginBinary,
		"--run-dir", runDir,
		"--kubeconfig-source", o.Kubeconfig,
		"--health-addr", "127.0.0.1:0",
		"--log-level", "debug",
	}
	if !o.NoKubeconfig {
		args = append(args, "--kubeconfig", o.Kubeconfig)
	}
	if o.NodeName != "-" {
		args = append(args, "--node-name", o.NodeName)
	}
	if o.PodName != "" {
		args = append(args, "--pod-name", o.PodName)
	}
	if o.PodNamespace != "" {
		args = append(args, "--pod-namespace", o.PodNamespace)
	}
	args = append(args, o.Args...)
	a.keep = slices.ContainsFunc(o.Args, func(s string) bool {
		return s == "--keep-on-exit" || s == "--keep-on-exit=true" || s == "--keep-on-exit=always" || s == "-keep-on-exit"
	})

	conf := snapshot(t, o.ConfDir)
	// The plugin and its API helper as they were in the bin dir, restored at the end.
	installed := map[string][]byte{}
	for _, name := range []string{PluginBinary, podget.HelperName} {
		if b, err := os.ReadFile(filepath.Join(o.BinDir, name)); err == nil {
			installed[name] = b
		}
	}

	logf, err := os.Create(a.LogPath)
	if err != nil {
		t.Fatal(err)
	}
	a.cmd = exec.Command(filepath.Join(bins, AgentBinary), args...)
	a.cmd.Env = cleanEnv()
	a.cmd.Stdout, a.cmd.Stderr = logf, logf
	if err := a.cmd.Start(); err != nil {
		logf.Close()
		t.Fatalf("start meshcni-agent: %v", err)
	}
	a.PID = a.cmd.Process.Pid
	go func() {
		a.waitErr = a.cmd.Wait()
		logf.Close()
		close(a.done)
	}()
	t.Cleanup(func() {
		a.Stop()
		if t.Failed() {
			t.Logf("meshcni-agent pid %d: %s\nlog (%s):\n%s", a.PID, strings.Join(args, " "), a.LogPath, a.Log())
		}
		if !a.keep {
			if diff := compare(conf, snapshot(t, o.ConfDir)); diff != "" {
				t.Errorf("agenttest: the agent did not put %s back on exit:\n%s", o.ConfDir, diff)
			}
		}
		restore(t, o.ConfDir, conf)
		for _, name := range []string{PluginBinary, podget.HelperName} {
			dst := filepath.Join(o.BinDir, name)
			if b, ok := installed[name]; ok {
				if err := fileutil.WriteFileAtomic(dst, b, 0o755); err != nil {
					t.Errorf("agenttest: restore %s: %v", dst, err)
				}
			} else if err := os.Remove(dst); err != nil && !errors.Is(err, os.ErrNotExist) {
				t.Errorf("agenttest: %v", err)
			}
		}
		os.RemoveAll(runDir)
	})

	ctx, cancel := context.WithTimeout(context.Background(), o.Timeout)
	defer cancel()
	addr, err := a.listenAddr(ctx)
	if err != nil {
		t.Fatalf("agenttest: %v\n%s", err, a.Log())
	}
	a.HealthURL = "http://" + addr + "/healthz"
	a.ReadyURL = "http://" + addr + "/readyz"
	a.MetricsURL = "http://" + addr + "/metrics"
	if err := a.waitStatus(ctx, a.HealthURL, http.StatusOK); err != nil {
		t.Fatalf("agenttest: /healthz: %v\n%s", err, a.Log())
	}
	if !o.NoWaitReady {
		if err := a.WaitReady(ctx); err != nil {
			t.Fatalf("agenttest: %v\n%s", err, a.Log())
		}
	}
	return a
}

// cleanEnv is the test's environment without MESHCNI_* (they would set the agent's
// flags) and without the in-cluster variables.
func cleanEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "MESHCNI_") || strings.HasPrefix(kv, "KUBERNETES_SERVICE_") {
			continue
		}
		env = append(env, kv)
	}
	return env
}

// listenAddr reads the health server's address from the agent's log.
func (a *Agent) listenAddr(ctx context.Context) (string, error) {
	for {
		f, err := os.Open(a.LogPath)
		if err != nil {
			return "", err
		}
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			var rec struct {
				Msg  string `json:"msg"`
				Addr string `json:"addr"`
			}
			if json.Unmarshal(sc.Bytes(), &rec) == nil && strings.Contains(rec.Msg, "/readyz") && rec.Addr != "" {
				f.Close()
				return rec.Addr, nil
			}
		}
		f.Close()
		select {
		case <-a.done:
			return "", fmt.Errorf("meshcni-agent exited before serving: %v", a.waitErr)
		case <-ctx.Done():
			return "", fmt.Errorf("meshcni-agent did not log its health address: %w", ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

var client = &http.Client{Timeout: 5 * time.Second}

// Get returns the status code and body of url.
func Get(url string) (int, string, error) {
	resp, err := client.Get(url)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

func (a *Agent) waitStatus(ctx context.Context, url string, want int) error {
	var last string
	for {
		code, body, err := Get(url)
		if err == nil && code == want {
			return nil
		}
		last = fmt.Sprintf("%d %s %v", code, strings.TrimSpace(body), err)
		select {
		case <-a.done:
			return fmt.Errorf("meshcni-agent exited (%v) while waiting for %s = %d; last: %s", a.waitErr, url, want, last)
		case <-ctx.Done():
			return fmt.Errorf("%s not %d: %w; last: %s", url, want, ctx.Err(), last)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// Ready returns /readyz's verdict and body (the reasons when not ready).
func (a *Agent) Ready() (bool, string, error) {
	code, body, err := Get(a.ReadyURL)
	if err != nil {
		return false, "", err
	}
	return code == http.StatusOK, body, nil
}

// WaitReady waits for /readyz 200.
func (a *Agent) WaitReady(ctx context.Context) error {
	return a.waitStatus(ctx, a.ReadyURL, http.StatusOK)
}

// Metrics scrapes /metrics with a real HTTP client and parses the text format.
func (a *Agent) Metrics(t testing.TB) map[string]*dto.MetricFamily {
	t.Helper()
	fams, err := a.Scrape()
	if err != nil {
		t.Fatal(err)
	}
	return fams
}

// Scrape is Metrics returning an error.
func (a *Agent) Scrape() (map[string]*dto.MetricFamily, error) {
	code, body, err := Get(a.MetricsURL)
	if err != nil {
		return nil, fmt.Errorf("scrape %s: %w", a.MetricsURL, err)
	}
	if code != http.StatusOK {
		return nil, fmt.Errorf("scrape %s: status %d", a.MetricsURL, code)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(strings.NewReader(body))
	if err != nil {
		return nil, fmt.Errorf("parse %s: %w", a.MetricsURL, err)
	}
	return fams, nil
}

// Value returns the value of the sample of metric name whose labels include want:
// a counter's or gauge's value, a histogram's sample count. ok is false when there is
// no such sample.
func Value(fams map[string]*dto.MetricFamily, name string, want map[string]string) (v float64, ok bool) {
	fam, found := fams[name]
	if !found {
		return 0, false
	}
next:
	for _, m := range fam.Metric {
		for k, v := range want {
			if !slices.ContainsFunc(m.Label, func(l *dto.LabelPair) bool { return l.GetName() == k && l.GetValue() == v }) {
				continue next
			}
		}
		switch {
		case m.Counter != nil:
			return m.Counter.GetValue(), true
		case m.Gauge != nil:
			return m.Gauge.GetValue(), true
		case m.Histogram != nil:
			return float64(m.Histogram.GetSampleCount()), true
		case m.Untyped != nil:
			return m.Untyped.GetValue(), true
		}
	}
	return 0, false
}

// Log returns the agent's log so far.
func (a *Agent) Log() string {
	b, err := os.ReadFile(a.LogPath)
	if err != nil {
		return fmt.Sprintf("(log unreadable: %v)", err)
	}
	return string(b)
}

// Exited reports whether the process has ended.
func (a *Agent) Exited() bool {
	select {
	case <-a.done:
		return true
	default:
		return false
	}
}

// Stop sends SIGTERM, waits up to 20 s (then kills) and fails the test unless the
// agent exited with code 0. It returns the same verdict; later calls return it again.
func (a *Agent) Stop() error {
	a.t.Helper()
	a.stopOnce.Do(func() {
		if !a.Exited() {
			_ = a.cmd.Process.Signal(syscall.SIGTERM)
		}
		select {
		case <-a.done:
		case <-time.After(20 * time.Second):
			_ = a.cmd.Process.Kill()
			<-a.done
			a.stopErr = errors.New("meshcni-agent did not exit within 20 s of SIGTERM (killed)")
		}
		if a.stopErr == nil && a.waitErr != nil {
			a.stopErr = fmt.Errorf("meshcni-agent exited: %w", a.waitErr)
		}
		if a.stopErr != nil {
			a.t.Errorf("agenttest: %v", a.stopErr)
		}
	})
	return a.stopErr
}

// file is a snapshot of one directory entry.
type file struct {
	data []byte
	mode os.FileMode
}

func snapshot(t testing.TB, dir string) map[string]file {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("agenttest: %v", err)
	}
	out := map[string]file{}
	for _, e := range ents {
		if !e.Type().IsRegular() {
			continue
		}
		p := filepath.Join(dir, e.Name())
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatalf("agenttest: %v", err)
		}
		fi, err := e.Info()
		if err != nil {
			t.Fatalf("agenttest: %v", err)
		}
		out[e.Name()] = file{data: b, mode: fi.Mode().Perm()}
	}
	return out
}

// compare says how got differs from want; JSON files compare as JSON values (the
// agent keeps content equivalent, not necessarily its whitespace).
func compare(want, got map[string]file) string {
	var d []string
	for n, w := range want {
		g, ok := got[n]
		switch {
		case !ok:
			d = append(d, fmt.Sprintf("%s: missing", n))
		case g.mode != w.mode:
			d = append(d, fmt.Sprintf("%s: mode %v, was %v", n, g.mode, w.mode))
		case !sameContent(w.data, g.data):
			d = append(d, fmt.Sprintf("%s: now\n%s\nwas\n%s", n, g.data, w.data))
		}
	}
	for n := range got {
		if _, ok := want[n]; !ok {
			d = append(d, fmt.Sprintf("%s: new file", n))
		}
	}
	slices.Sort(d)
	return strings.Join(d, "\n")
}

func sameContent(a, b []byte) bool {
	var va, vb any
	if json.Unmarshal(a, &va) == nil && json.Unmarshal(b, &vb) == nil {
		return reflect.DeepEqual(va, vb)
	}
	return string(a) == string(b)
}

// restore makes dir hold exactly the snapshot's regular files.
func restore(t testing.TB, dir string, snap map[string]file) {
	t.Helper()
	now := snapshot(t, dir)
	for n := range now {
		if _, ok := snap[n]; !ok {
			if err := os.Remove(filepath.Join(dir, n)); err != nil && !errors.Is(err, os.ErrNotExist) {
				t.Errorf("agenttest: restore %s: %v", dir, err)
			}
		}
	}
	for n, f := range snap {
		if g, ok := now[n]; ok && g.mode == f.mode && string(g.data) == string(f.data) {
			continue
		}
		if err := fileutil.WriteFileAtomic(filepath.Join(dir, n), f.data, f.mode); err != nil {
			t.Errorf("agenttest: restore %s: %v", dir, err)
		}
	}
}

// RSS returns the agent's resident set size in bytes (VmRSS of /proc/PID/status).
func (a *Agent) RSS() (int64, error) { return VmRSS(a.PID) }

// VmRSS returns a process's resident set size in bytes, from /proc/PID/status.
func VmRSS(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			var kb int64
			if _, err := fmt.Sscanf(strings.TrimSpace(rest), "%d kB", &kb); err != nil {
				return 0, fmt.Errorf("parse VmRSS %q: %w", rest, err)
			}
			return kb * 1024, nil
		}
	}
	return 0, fmt.Errorf("no VmRSS in /proc/%d/status", pid)
}
