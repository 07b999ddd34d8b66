package agenttest

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/meshcni/meshcni/pkg/podget"
)

func TestMain(m *testing.M) {
	code := m.Run()
	RemoveBinaries()
	os.Exit(code)
}

const primary = `{
  "cniVersion": "1.0.0",
  "name": "k8s",
  "plugins": [{"type": "bridge", "bridge": "cni0"}, {"type": "portmap", "capabilities": {"portMappings": true}}]
}
`

// kubeconfig is a syntactically valid kubeconfig; the agent only copies it for the
// plugin (no API access is attempted without --kubeconfig).
const kubeconfig = `apiVersion: v1
kind: Config
clusters:
- name: c
  cluster: {server: "https://127.0.0.1:1", insecure-skip-tls-verify: true}
users:
- name: u
  user: {token: t}
contexts:
- name: x
  context: {cluster: c, user: u}
current-context: x
`

// dirs makes a CNI configuration directory holding a primary list, a plugin
// directory and a kubeconfig file.
func dirs(t *testing.T) (conf, bin, kc string) {
	t.Helper()
	root := t.TempDir()
	conf, bin, kc = filepath.Join(root, "net.d"), filepath.Join(root, "bin"), filepath.Join(root, "kubeconfig")
	for _, d := range []string{conf, bin} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(conf, "10-k8s.conflist"), []byte(primary), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(kc, []byte(kubeconfig), 0o600); err != nil {
		t.Fatal(err)
	}
	return conf, bin, kc
}

// TestStartStop runs the real binary in temporary directories: ready, scraped,
// installed while running, uninstalled (and the directory as before) after Stop.
func TestStartStop(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		keep bool
	}{
		{"uninstall", nil, false},
		{"keep-on-exit", []string{"--keep-on-exit"}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			conf, bin, kc := dirs(t)
			a := Start(t, Options{ConfDir: conf, BinDir: bin, Kubeconfig: kc, NoKubeconfig: true, NodeName: "-", Args: tc.args})
			ok, body, err := a.Ready()
			if err != nil || !ok {
				t.Fatalf("ready: %v %v %s", ok, err, body)
			}
			fams := a.Metrics(t)
			if v, ok := Value(fams, "meshcni_agent_ready", nil); !ok || v != 1 {
				t.Fatalf("meshcni_agent_ready = %v (present %v)", v, ok)
			}
			if v, _ := Value(fams, "meshcni_agent_installs_total", map[string]string{"result": "success"}); v < 3 {
				t.Fatalf("installs success = %v, want ≥ 3 (binary, kubeconfig, entry)", v)
			}
			rss, err := a.RSS()
			if err != nil || rss < 1<<20 {
				t.Fatalf("RSS %d: %v", rss, err)
			}
			b, err := os.ReadFile(filepath.Join(conf, "10-k8s.conflist"))
			if err != nil || !strings.Contains(string(b), `"meshcni"`) {
				t.Fatalf("no meshcni entry while running: %v\n%s", err, b)
			}
			if err := a.Stop(); err != nil {
				t.Fatal(err)
			}
			_, binErr := os.Stat(filepath.Join(bin, PluginBinary))
			_, kcErr := os.Stat(filepath.Join(a.RunDir, "meshcni-kubeconfig"))
			b, _ = os.ReadFile(filepath.Join(conf, "10-k8s.conflist"))
			if kept := strings.Contains(string(b), `"meshcni"`); kept != tc.keep {
				t.Fatalf("entry kept %v, want %v:\n%s", kept, tc.keep, b)
			}
			if (binErr == nil) != tc.keep || (kcErr == nil) != tc.keep {
				t.Fatalf("after exit: binary %v, kubeconfig %v; want kept=%v", binErr, kcErr, tc.keep)
			}
			if !strings.Contains(a.Log(), "serving /healthz") {
				t.Fatalf("log not captured:\n%s", a.Log())
			}
		})
	}
}

// TestNotReadyUntilBinary starts the agent with its plugin source missing: /readyz is
// 503 and the configuration untouched; once the binary appears, the resync installs
// everything and /readyz flips to 200.
func TestNotReadyUntilBinary(t *testing.T) {
	conf, bin, kc := dirs(t)
	src := filepath.Join(t.TempDir(), "meshcni")
	a := Start(t, Options{ConfDir: conf, BinDir: bin, Kubeconfig: kc, NoKubeconfig: true, NodeName: "-",
		PluginBinary: src, NoWaitReady: true, Args: []string{"--resync", "200ms"}})
	ok, body, err := a.Ready()
	if err != nil || ok || !strings.Contains(body, "binary") {
		t.Fatalf("ready %v (%v): %s; want 503 naming the binary", ok, err, body)
	}
	if b, _ := os.ReadFile(filepath.Join(conf, "10-k8s.conflist")); string(b) != primary {
		t.Fatalf("configuration touched before the binary is in place:\n%s", b)
	}
	// The plugin's API helper first: without it the agent installs nothing either.
	helper, err := os.ReadFile(filepath.Join(Binaries(t), podget.HelperName))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(filepath.Dir(src), podget.HelperName), helper, 0o755); err != nil {
		t.Fatal(err)
	}
	// Two failed installs counted after the helper is in place: at least one resync
	// (every 200 ms, one at a time) ran wholly after it. Still not ready: the plugin
	// is missing.
	failed := func() float64 {
		v, _ := Value(a.Metrics(t), "meshcni_agent_installs_total", map[string]string{"result": "error"})
		return v
	}
	since := failed()
	for deadline := time.Now().Add(10 * time.Second); failed() < since+2; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("no resync within 10s (failed installs %v, were %v)", failed(), since)
		}
	}
	if ok, body, err := a.Ready(); err != nil || ok || !strings.Contains(body, "plugin binary source") {
		t.Fatalf("ready %v (%v): %s; want 503 naming the plugin binary", ok, err, body)
	}
	plugin, err := os.ReadFile(filepath.Join(Binaries(t), PluginBinary))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(src, plugin, 0o755); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := a.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
}
