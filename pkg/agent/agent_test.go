package agent

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"maps"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	promtestutil "github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/meshcni/meshcni/pkg/fileutil"
	"github.com/meshcni/meshcni/pkg/install"
	"github.com/meshcni/meshcni/pkg/podget"
)

// goldenDir holds the configuration-directory shapes shared with pkg/install.
const goldenDir = "../install/testdata"

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

type fakeRecorder struct {
	mu     sync.Mutex
	events []string
}

func (r *fakeRecorder) Warning(reason, msg string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events = append(r.events, reason+": "+msg)
}

func (r *fakeRecorder) all() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.events...)
}

// env is a node laid out in temp dirs.
type env struct {
	root, binDir, confDir, runDir, pluginSrc, saDir string
	kubeconfigSrc                                   string
}

func newEnv(t testing.TB) *env {
	t.Helper()
	root := t.TempDir()
	e := &env{
		root:      root,
		binDir:    filepath.Join(root, "opt/cni/bin"),
		confDir:   filepath.Join(root, "etc/cni/net.d"),
		runDir:    filepath.Join(root, "var/run/meshcni"),
		pluginSrc: filepath.Join(root, "image/meshcni"),
		saDir:     filepath.Join(root, "sa"),
	}
	// A unix socket path has at most 107 bytes: the run dir gets a short name.
	short, err := os.MkdirTemp("", "mcni")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(short) })
	e.runDir = filepath.Join(short, "run")
	for _, d := range []string{e.binDir, e.confDir, filepath.Dir(e.pluginSrc), e.saDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(e.pluginSrc, []byte("#!/bin/false\nmeshcni plugin v1\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(filepath.Dir(e.pluginSrc), podget.HelperName), []byte("#!/bin/false\nmeshcni-podget v1\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	e.kubeconfigSrc = filepath.Join(root, "admin.conf")
	kc := "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://127.0.0.1:6443\n    insecure-skip-tls-verify: true\nusers:\n- name: u\n  user:\n    token: abc\ncontexts:\n- name: x\n  context: {cluster: c, user: u}\ncurrent-context: x\n"
	if err := os.WriteFile(e.kubeconfigSrc, []byte(kc), 0o600); err != nil {
		t.Fatal(err)
	}
	return e
}

func (e *env) args(extra ...string) []string {
	return append([]string{
		"--cni-bin-dir", e.binDir, "--cni-conf-dir", e.confDir, "--run-dir", e.runDir,
		"--plugin-binary", e.pluginSrc, "--kubeconfig-source", e.kubeconfigSrc,
		"--health-addr", "127.0.0.1:0", "--debounce", "2ms", "--log-level", "debug",
		"--token-file", filepath.Join(e.saDir, "token"), "--ca-file", filepath.Join(e.saDir, "ca.crt"),
	}, extra...)
}

// normalized reads the configuration directory with the env's paths replaced by the
// node paths the golden files use.
func (e *env) normalized(t testing.TB) map[string]string {
	files := readDir(t, e.confDir)
	for n, c := range files {
		c = strings.ReplaceAll(c, e.runDir, "/var/run/meshcni")
		files[n] = strings.ReplaceAll(c, e.binDir, "/opt/cni/bin")
	}
	return files
}

type running struct {
	a    *Agent
	log  *syncBuffer
	rec  *fakeRecorder
	addr string
	stop func() error
}

func startAgent(t testing.TB, args []string, getenv func(string) string) *running {
	t.Helper()
	return startAgentWith(t, args, Options{Getenv: getenv}, nil)
}

// startAgentKube is startAgent with API access through kube (nil: none).
func startAgentKube(t testing.TB, args []string, getenv func(string) string, kube *Kube) *running {
	t.Helper()
	return startAgentWith(t, args, Options{Getenv: getenv, Kube: kube}, nil)
}

// startAgentWith starts the agent with opts (its Recorder is the test's); prepare, if
// not nil, sees the agent before it runs.
func startAgentWith(t testing.TB, args []string, opts Options, prepare func(*Agent)) *running {
	t.Helper()
	if opts.Getenv == nil {
		opts.Getenv = func(string) string { return "" }
	}
	cfg, err := ParseFlags(args, opts.Getenv, os.Stderr)
	if err != nil {
		t.Fatalf("ParseFlags: %v", err)
	}
	r := &running{log: &syncBuffer{}, rec: &fakeRecorder{}}
	log := slog.New(slog.NewJSONHandler(r.log, &slog.HandlerOptions{Level: cfg.LogLevel}))
	opts.Recorder = r.rec
	a, err := New(cfg, log, opts)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	r.a = a
	if prepare != nil {
		prepare(a)
	}
	a.Health.listening = make(chan net.Addr, 1)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	select {
	case addr := <-a.Health.listening:
		r.addr = addr.String()
	case err := <-done:
		cancel()
		t.Fatalf("agent stopped at start: %v", err)
	}
	var once sync.Once
	var runErr error
	r.stop = func() error {
		once.Do(func() {
			cancel()
			select {
			case runErr = <-done:
			case <-time.After(10 * time.Second):
				runErr = errors.New("agent did not stop")
			}
		})
		return runErr
	}
	t.Cleanup(func() {
		_ = r.stop()
		if t.Failed() {
			t.Logf("agent log:\n%s", r.log.String())
		}
	})
	return r
}

func eventually(t testing.TB, timeout time.Duration, what string, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var err error
	for time.Now().Before(deadline) {
		if err = cond(); err == nil {
			return
		}
		time.Sleep(2 * time.Millisecond)
	}
	t.Fatalf("%s: not within %v: %v", what, timeout, err)
}

func readDir(t testing.TB, dir string) map[string]string {
	t.Helper()
	out := map[string]string{}
	ents, _ := os.ReadDir(dir) // a missing or broken directory reads as empty
	for _, e := range ents {
		if e.IsDir() {
			continue
		}
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			continue // replaced meanwhile
		}
		out[e.Name()] = string(b)
	}
	return out
}

// sameDir compares file sets; JSON content is compared compacted (key order kept), as
// a file that held our entry on the way may be re-indented.
func sameDir(got, want map[string]string) error {
	compact := func(s string) string {
		var b bytes.Buffer
		if json.Compact(&b, []byte(s)) != nil {
			return s
		}
		return b.String()
	}
	for n, w := range want {
		if g, ok := got[n]; !ok || compact(g) != compact(w) {
			return errors.New(n + " differs or is missing")
		}
	}
	for n := range got {
		if _, ok := want[n]; !ok {
			return errors.New(n + " is extra")
		}
	}
	return nil
}

type caseOptions struct {
	Chained     *bool  `json:"chained"`
	FileName    string `json:"file_name"`
	NetworkName string `json:"network_name"`
	// UninstallLeaves: lists that do not parse, which uninstall leaves alone; the
	// plugin's binary and kubeconfig stay for the entry they may hold.
	UninstallLeaves []string `json:"uninstall_leaves"`
}

func caseLeaves(t *testing.T, dir string) []string {
	data, err := os.ReadFile(filepath.Join(dir, "options.json"))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	var co caseOptions
	if err == nil {
		err = json.Unmarshal(data, &co)
	}
	if err != nil {
		t.Fatal(err)
	}
	return co.UninstallLeaves
}

func caseArgs(t *testing.T, dir string) []string {
	data, err := os.ReadFile(filepath.Join(dir, "options.json"))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	var co caseOptions
	if err := json.Unmarshal(data, &co); err != nil {
		t.Fatal(err)
	}
	var args []string
	if co.Chained != nil && !*co.Chained {
		args = append(args, "--chained=false")
	}
	if co.FileName != "" {
		args = append(args, "--cni-conf-file-name", co.FileName)
	}
	if co.NetworkName != "" {
		args = append(args, "--network-name", co.NetworkName)
	}
	return args
}

// The agent starts on an empty configuration directory; each shape's files then appear
// (as a primary CNI writes them, atomically, one by one); the agent converges to the
// golden "after" state, and on shutdown to the "uninstalled" one.
func TestAgentGoldenShapes(t *testing.T) {
	ents, err := os.ReadDir(goldenDir)
	if err != nil {
		t.Fatal(err)
	}
	for _, ent := range ents {
		if !ent.IsDir() {
			continue
		}
		t.Run(ent.Name(), func(t *testing.T) {
			tc := filepath.Join(goldenDir, ent.Name())
			e := newEnv(t)
			r := startAgent(t, e.args(caseArgs(t, tc)...), nil)

			// Nothing to chain into yet: not ready, and the binary and kubeconfig are in.
			eventually(t, 5*time.Second, "binary installed", func() error { return r.a.Guard.Binary.Check() })
			eventually(t, 5*time.Second, "kubeconfig written", func() error { return r.a.Guard.Kubeconfig.Check() })
			if chained := caseArgs(t, tc); len(chained) == 0 || chained[0] != "--chained=false" {
				if err := r.a.Guard.Ready(); err == nil {
					t.Error("ready with no CNI configuration")
				}
			}

			// In lexical order, so the primary (kubelet's first) appears first: the golden
			// "after" states assume the agent never chained into a later file meanwhile
			// (map order made that random: a .conf written first got converted).
			before := readDir(t, filepath.Join(tc, "before"))
			for _, name := range slices.Sorted(maps.Keys(before)) {
				if err := fileutil.WriteFileAtomic(filepath.Join(e.confDir, name), []byte(before[name]), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want := readDir(t, filepath.Join(tc, "after"))
			eventually(t, 5*time.Second, "converged to the golden after state", func() error {
				if err := r.a.Guard.Ready(); err != nil {
					return err
				}
				return sameDir(e.normalized(t), want)
			})

			leaves := caseLeaves(t, tc)
			err := r.stop()
			switch {
			case len(leaves) == 0 && err != nil:
				t.Fatalf("agent stopped with %v", err)
			case len(leaves) > 0 && !errors.Is(err, install.ErrInvalid):
				t.Fatalf("agent stopped with %v, want an ErrInvalid naming %v", err, leaves)
			}
			for _, name := range leaves {
				if !strings.Contains(err.Error(), name) {
					t.Errorf("stop error %q does not name %s", err, name)
				}
			}
			if err := sameDir(e.normalized(t), readDir(t, filepath.Join(tc, "uninstalled"))); err != nil {
				t.Errorf("after uninstall: %v", err)
			}
			for _, p := range []string{filepath.Join(e.binDir, "meshcni"), filepath.Join(e.binDir, podget.HelperName), filepath.Join(e.runDir, KubeconfigName)} {
				if _, err := os.Stat(p); len(leaves) == 0 && !errors.Is(err, fs.ErrNotExist) {
					t.Errorf("%s left after uninstall (%v)", p, err)
				} else if len(leaves) > 0 && err != nil {
					t.Errorf("%s removed although %v may hold meshcni's entry (%v)", p, leaves, err)
				}
			}
		})
	}
}

const calico = `{
  "name": "k8s-pod-network",
  "cniVersion": "0.3.1",
  "plugins": [
    {"type": "calico", "datastore_type": "kubernetes", "ipam": {"type": "calico-ipam"}},
    {"type": "portmap", "snat": true, "capabilities": {"portMappings": true}}
  ]
}
`

func hasEntry(path string) bool {
	b, err := os.ReadFile(path)
	return err == nil && bytes.Contains(b, []byte(`"type": "meshcni"`))
}

// A primary CNI rewrites its file (atomically) 1000 times; after each settle our entry
// is back, and a concurrent reader never reads a corrupt file.
func TestPrimaryRewrites1000Times(t *testing.T) {
	e := newEnv(t)
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	if err := fileutil.WriteFileAtomic(primary, []byte(calico), 0o644); err != nil {
		t.Fatal(err)
	}
	r := startAgent(t, e.args("--conflict-threshold", "0", "--log-level", "info"), nil)
	eventually(t, 5*time.Second, "ready", r.a.Guard.Ready)

	stop := make(chan struct{})
	var reads, corrupt int
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			b, err := os.ReadFile(primary)
			if err != nil {
				continue
			}
			reads++
			if !json.Valid(b) {
				corrupt++
			}
		}
	}()
	rounds := 1000
	if testing.Short() {
		rounds = 100 // the unit loop (make unit); make e2e runs all 1000
	}
	lat := rewriteLoop(t, primary, rounds)
	close(stop)
	wg.Wait()
	if corrupt > 0 {
		t.Errorf("%d of %d concurrent reads saw corrupt JSON", corrupt, reads)
	}
	if err := r.a.Guard.Ready(); err != nil {
		t.Errorf("not ready after the loop: %v", err)
	}
	p50, p99 := percentile(lat, 50), percentile(lat, 99)
	t.Logf("re-injection latency over %d rewrites: p50 %v, p99 %v, max %v (%d concurrent reads)", len(lat), p50, p99, percentile(lat, 100), reads)
}

// rewriteLoop rewrites path without our entry n times, each time waiting for the
// agent to put it back, and returns the latencies.
func rewriteLoop(t testing.TB, path string, n int) []time.Duration {
	t.Helper()
	lat := make([]time.Duration, 0, n)
	for i := range n {
		content := strings.Replace(calico, `"snat": true`, `"snat": true, "gen": `+itoa(i), 1)
		start := time.Now()
		if err := fileutil.WriteFileAtomic(path, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		deadline := start.Add(5 * time.Second)
		for !hasEntry(path) {
			if time.Now().After(deadline) {
				t.Fatalf("rewrite %d: entry not back within 5s", i)
			}
			time.Sleep(50 * time.Microsecond)
		}
		lat = append(lat, time.Since(start))
		b, _ := os.ReadFile(path)
		if !bytes.Contains(b, []byte(`"gen": `+itoa(i))) {
			t.Fatalf("rewrite %d: the primary's own change was lost", i)
		}
	}
	return lat
}

func itoa(i int) string { return big.NewInt(int64(i)).String() }

func percentile(d []time.Duration, p int) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), d...)
	for i := 1; i < len(s); i++ { // insertion sort: small n
		for j := i; j > 0 && s[j] < s[j-1]; j-- {
			s[j], s[j-1] = s[j-1], s[j]
		}
	}
	i := (len(s)*p + 99) / 100
	if i < 1 {
		i = 1
	}
	return s[i-1]
}

// BenchmarkReinjection measures how fast the entry is back after a primary rewrite.
// Run with -benchtime 1000x for the figures in docs/agent.md.
func BenchmarkReinjection(b *testing.B) {
	e := newEnv(b)
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	if err := fileutil.WriteFileAtomic(primary, []byte(calico), 0o644); err != nil {
		b.Fatal(err)
	}
	r := startAgent(b, e.args("--conflict-threshold", "0", "--log-level", "warn", "--debounce", "10ms"), nil) // the default debounce
	eventually(b, 5*time.Second, "ready", r.a.Guard.Ready)
	b.ResetTimer()
	lat := rewriteLoop(b, primary, b.N)
	b.StopTimer()
	b.ReportMetric(float64(percentile(lat, 50).Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(percentile(lat, 99).Microseconds())/1000, "p99-ms")
}

// Two writers fighting: the agent backs off, and reports the conflict in the metric,
// an Event and the log, naming the file.
func TestConflictBacksOff(t *testing.T) {
	for _, tc := range []struct {
		name  string
		args  []string
		fight func(t *testing.T, e *env) string // one round; returns the file fought over
	}{
		{"primary drops our entry", nil, func(t *testing.T, e *env) string {
			p := filepath.Join(e.confDir, "10-calico.conflist")
			if hasEntry(p) {
				if err := fileutil.WriteFileAtomic(p, []byte(calico), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			return "10-calico.conflist"
		}},
		{"exclusive CNI deletes our standalone file", []string{"--chained=false"}, func(t *testing.T, e *env) string {
			_ = os.Remove(filepath.Join(e.confDir, "meshcni.conflist"))
			return "meshcni.conflist"
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			if err := fileutil.WriteFileAtomic(filepath.Join(e.confDir, "10-calico.conflist"), []byte(calico), 0o644); err != nil {
				t.Fatal(err)
			}
			r := startAgent(t, e.args(append(tc.args, "--conflict-threshold", "3", "--backoff-max", "400ms")...), nil)
			eventually(t, 5*time.Second, "ready", r.a.Guard.Ready)
			var file string
			deadline := time.Now().Add(3 * time.Second)
			for time.Now().Before(deadline) {
				file = tc.fight(t, e)
				time.Sleep(time.Millisecond)
			}
			reinj := counterValue(t, r.a.Metrics.Reinjections)
			// Without a backoff the agent re-injects after every rewrite of the fight.
			if reinj > 100 {
				t.Errorf("%v re-injections in 3 s of fighting: no backoff", reinj)
			}
			if c := counterValue(t, r.a.Metrics.Conflicts.WithLabelValues(file)); c < 1 {
				t.Errorf("meshcni_agent_conflicts_total{file=%q} = %v", file, c)
			}
			ev := r.rec.all()
			if len(ev) != 1 || !strings.Contains(ev[0], "ConfigConflict") || !strings.Contains(ev[0], file) {
				t.Errorf("events = %q, want one ConfigConflict naming %s", ev, file)
			}
			if !strings.Contains(r.log.String(), "another writer keeps removing") {
				t.Error("conflict not logged")
			}
			// The fight ends: the entry comes back after the backoff.
			eventually(t, 5*time.Second, "ready after the fight", r.a.Guard.Ready)
			t.Logf("%v re-injections in 3 s of fighting over %s", reinj, file)
		})
	}
}

func testCA(t testing.TB) []byte {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "ca"},
		NotBefore: time.Now(), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}

var tsCounter int

// projectedSwap lays files out in dir the way kubelet's atomic writer does: a new
// ..<ts> directory, ..data swapped to it by a symlink rename, file → ..data/file.
func projectedSwap(t testing.TB, dir string, files map[string][]byte) {
	t.Helper()
	tsCounter++
	ts := filepath.Join(dir, "..2026_01_01_00_00_00."+itoa(tsCounter))
	if err := os.Mkdir(ts, 0o755); err != nil {
		t.Fatal(err)
	}
	for n, c := range files {
		if err := os.WriteFile(filepath.Join(ts, n), c, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	old, _ := os.Readlink(filepath.Join(dir, "..data"))
	if err := os.Symlink(filepath.Base(ts), filepath.Join(dir, "..data_tmp")); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(dir, "..data_tmp"), filepath.Join(dir, "..data")); err != nil {
		t.Fatal(err)
	}
	for n := range files {
		if _, err := os.Lstat(filepath.Join(dir, n)); err != nil {
			if err := os.Symlink(filepath.Join("..data", n), filepath.Join(dir, n)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if old != "" {
		os.RemoveAll(filepath.Join(dir, old))
	}
}

func inClusterEnv(k string) string {
	return map[string]string{"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}[k]
}

func TestTokenRotationRewritesKubeconfig(t *testing.T) {
	e := newEnv(t)
	ca := testCA(t)
	projectedSwap(t, e.saDir, map[string][]byte{"token": []byte("token-one"), "ca.crt": ca})
	if err := fileutil.WriteFileAtomic(filepath.Join(e.confDir, "10-calico.conflist"), []byte(calico), 0o644); err != nil {
		t.Fatal(err)
	}
	args := e.args("--kubeconfig-source", "", "--plugin-service-account=") // in-cluster: the agent's own token + CA
	r := startAgent(t, args, inClusterEnv)
	kc := filepath.Join(e.runDir, KubeconfigName)
	eventually(t, 5*time.Second, "ready", r.a.Guard.Ready)
	b, _ := os.ReadFile(kc)
	if !bytes.Contains(b, []byte("token-one")) || !bytes.Contains(b, []byte("https://[fd00::1]:443")) {
		t.Fatalf("kubeconfig:\n%s", b)
	}
	if fi, _ := os.Stat(kc); fi.Mode().Perm() != 0o600 {
		t.Errorf("kubeconfig mode %v", fi.Mode().Perm())
	}
	for i, tok := range []string{"token-two", "token-three"} {
		projectedSwap(t, e.saDir, map[string][]byte{"token": []byte(tok), "ca.crt": ca})
		eventually(t, 2*time.Second, "kubeconfig rewritten after rotation "+itoa(i), func() error {
			b, _ := os.ReadFile(kc)
			if !bytes.Contains(b, []byte(tok)) {
				return errors.New("old token")
			}
			return nil
		})
	}
	// Someone deletes the kubeconfig: it comes back.
	os.Remove(kc)
	eventually(t, 2*time.Second, "kubeconfig restored", r.a.Guard.Kubeconfig.Check)
}

// TestBinaryAndHelperRestored: the plugin binary and its API helper are guarded
// alike: removed, or replaced by a symlink, either is reinstalled on the file event,
// long before the resync.
func TestBinaryAndHelperRestored(t *testing.T) {
	e := newEnv(t)
	if err := fileutil.WriteFileAtomic(filepath.Join(e.confDir, "10-calico.conflist"), []byte(calico), 0o644); err != nil {
		t.Fatal(err)
	}
	r := startAgent(t, e.args("--resync", "10m"), inClusterEnv)
	eventually(t, 5*time.Second, "ready", r.a.Guard.Ready)
	// Let the events of the agent's own first install pass (debounce 2 ms), so that
	// only the damage below can trigger a reinstall.
	time.Sleep(300 * time.Millisecond)
	helper := filepath.Join(e.binDir, podget.HelperName)
	plugin := filepath.Join(e.binDir, "meshcni")
	for _, tc := range []struct {
		name   string
		damage func() error
	}{
		{"helper removed", func() error { return os.Remove(helper) }},
		{"plugin removed", func() error { return os.Remove(plugin) }},
		{"helper replaced by a symlink to the same content", func() error {
			tmp := helper + ".link"
			if err := os.Symlink(filepath.Join(filepath.Dir(e.pluginSrc), podget.HelperName), tmp); err != nil {
				return err
			}
			return os.Rename(tmp, helper)
		}},
	} {
		if err := tc.damage(); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		eventually(t, 3*time.Second, tc.name+": reinstalled", func() error {
			for _, p := range []string{helper, plugin} {
				fi, err := os.Lstat(p)
				if err != nil {
					return err
				}
				if !fi.Mode().IsRegular() {
					return fmt.Errorf("%s is %v", p, fi.Mode().Type())
				}
			}
			return r.a.Guard.Binary.Check()
		})
	}
}

func counterValue(t testing.TB, c prometheus.Collector) float64 {
	t.Helper()
	return promtestutil.ToFloat64(c)
}

func recordOf(msg string, args ...any) slog.Record {
	r := slog.NewRecord(time.Now(), slog.LevelInfo, msg, 0)
	r.Add(args...)
	return r
}
