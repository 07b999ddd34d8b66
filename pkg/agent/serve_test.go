package agent

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/meshcni/meshcni/internal/testkit/agenttest"
	"github.com/meshcni/meshcni/pkg/agentsock"
	"github.com/meshcni/meshcni/pkg/fileutil"
)

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	c := &http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func scrape(t *testing.T, addr string) map[string]*dto.MetricFamily {
	t.Helper()
	code, body := get(t, "http://"+addr+"/metrics")
	if code != 200 {
		t.Fatalf("/metrics: %d", code)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(strings.NewReader(body))
	if err != nil {
		t.Fatalf("parse /metrics: %v", err)
	}
	return fams
}

func TestHealthMetricsAndPluginSocket(t *testing.T) {
	e := newEnv(t)
	if err := fileutil.WriteFileAtomic(filepath.Join(e.confDir, "10-calico.conflist"), []byte(calico), 0o644); err != nil {
		t.Fatal(err)
	}
	r := startAgent(t, e.args(), nil)
	base := "http://" + r.addr
	if code, _ := get(t, base+"/healthz"); code != 200 {
		t.Errorf("/healthz = %d", code)
	}
	eventually(t, 5*time.Second, "/readyz 200", func() error {
		if code, body := get(t, base+"/readyz"); code != 200 {
			return fmt.Errorf("%d %s", code, body)
		}
		return nil
	})

	// The plugin reports through the socket.
	c, err := agentsock.Dial(e.runDir)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	pod := agentsock.Pod{Namespace: "shop", Name: "cart-7d9f"}
	for _, x := range []struct {
		cmd, res string
		d        time.Duration
	}{{"ADD", "success", 30 * time.Millisecond}, {"ADD", "error", 2 * time.Second}, {"DEL", "success", time.Millisecond}, {"BOGUS", "weird", 0}} {
		if err := c.ReportCommand(x.cmd, x.res, x.d, pod, nil); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.Handler(nil, nil).Handle(t.Context(), recordOf("redirect applied", agentsock.KeyPodNamespace, "shop", agentsock.KeyPodName, "cart-7d9f", "backend", "nftables")); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "plugin log record in the agent's log", func() error {
		for _, line := range strings.Split(r.log.String(), "\n") {
			if !strings.Contains(line, "redirect applied") {
				continue
			}
			var rec map[string]any
			if err := json.Unmarshal([]byte(line), &rec); err != nil {
				return err
			}
			if rec["pod_namespace"] != "shop" || rec["pod_name"] != "cart-7d9f" || rec["backend"] != "nftables" || rec["source"] != "plugin" {
				return fmt.Errorf("record %v", rec)
			}
			return nil
		}
		return errors.New("not logged")
	})

	var fams map[string]*dto.MetricFamily
	eventually(t, 5*time.Second, "command metrics", func() error {
		fams = scrape(t, r.addr)
		if v, _ := agenttest.Value(fams, "meshcni_plugin_cmd_total", map[string]string{"command": "other", "result": "other"}); v != 1 {
			return fmt.Errorf("other/other = %v", v)
		}
		return nil
	})
	for _, tc := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"meshcni_agent_ready", nil, 1},
		{"meshcni_agent_installs_total", map[string]string{"result": "success"}, 3},
		{"meshcni_agent_installs_total", map[string]string{"result": "error"}, 0},
		{"meshcni_agent_reinjections_total", nil, 0},
		{"meshcni_plugin_cmd_total", map[string]string{"command": "ADD", "result": "success"}, 1},
		{"meshcni_plugin_cmd_total", map[string]string{"command": "ADD", "result": "error"}, 1},
		{"meshcni_plugin_cmd_total", map[string]string{"command": "DEL", "result": "success"}, 1},
		{"meshcni_plugin_add_duration_seconds", map[string]string{"result": "success"}, 1},
		{"meshcni_plugin_add_duration_seconds", map[string]string{"result": "error"}, 1},
	} {
		got, ok := agenttest.Value(fams, tc.name, tc.labels)
		if !ok || got != tc.want {
			t.Errorf("%s%v = %v (present %v), want %v", tc.name, tc.labels, got, ok, tc.want)
		}
	}
	if _, ok := fams["go_goroutines"]; !ok {
		t.Error("no Go runtime metrics")
	}

	// The primary drops our entry: put back, counted, /readyz stays green after.
	if err := fileutil.WriteFileAtomic(filepath.Join(e.confDir, "10-calico.conflist"), []byte(calico), 0o644); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "re-injection counted", func() error {
		if v, _ := agenttest.Value(scrape(t, r.addr), "meshcni_agent_reinjections_total", nil); v != 1 {
			return fmt.Errorf("reinjections = %v", v)
		}
		return nil
	})
}

// Bad input: a clear message, /readyz false, nothing overwritten.
func TestBadInputNotReady(t *testing.T) {
	for _, tc := range []struct {
		name    string
		setup   func(t *testing.T, e *env) []string
		wantMsg string
	}{
		{"conf dir is not a directory", func(t *testing.T, e *env) []string {
			os.RemoveAll(e.confDir)
			if err := os.WriteFile(e.confDir, []byte("x"), 0o644); err != nil {
				t.Fatal(err)
			}
			return nil
		}, "not a directory"},
		{"malformed primary", func(t *testing.T, e *env) []string {
			if err := os.WriteFile(filepath.Join(e.confDir, "10-calico.conflist"), []byte(`{"name":"x","plugins":[{"type":`), 0o644); err != nil {
				t.Fatal(err)
			}
			return []string{"--cni-conf-file-name", "10-calico.conflist"}
		}, "10-calico.conflist is invalid"},
		{"missing token", func(t *testing.T, e *env) []string {
			if err := os.WriteFile(filepath.Join(e.confDir, "10-calico.conflist"), []byte(calico), 0o644); err != nil {
				t.Fatal(err)
			}
			return []string{"--kubeconfig-source", "", "--plugin-service-account="}
		}, "service-account token"},
		{"missing plugin binary", func(t *testing.T, e *env) []string {
			if err := os.WriteFile(filepath.Join(e.confDir, "10-calico.conflist"), []byte(calico), 0o644); err != nil {
				t.Fatal(err)
			}
			os.Remove(e.pluginSrc)
			return nil
		}, "plugin binary source"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			extra := tc.setup(t, e)
			before := readDir(t, e.confDir)
			r := startAgent(t, e.args(extra...), inClusterEnv)
			eventually(t, 5*time.Second, "clear message in the log", func() error {
				if !strings.Contains(r.log.String(), tc.wantMsg) {
					return errors.New("not yet")
				}
				return nil
			})
			code, body := get(t, "http://"+r.addr+"/readyz")
			if code != http.StatusServiceUnavailable || !strings.Contains(body, tc.wantMsg) {
				t.Errorf("/readyz = %d %q, want 503 naming %q", code, body, tc.wantMsg)
			}
			if v, _ := agenttest.Value(scrape(t, r.addr), "meshcni_agent_ready", nil); v != 0 {
				t.Errorf("meshcni_agent_ready = %v", v)
			}
			if after := readDir(t, e.confDir); sameDir(after, before) != nil {
				t.Errorf("configuration changed: %v → %v", before, after)
			}
		})
	}
}

func TestKeepOnExit(t *testing.T) {
	e := newEnv(t)
	if err := fileutil.WriteFileAtomic(filepath.Join(e.confDir, "10-calico.conflist"), []byte(calico), 0o644); err != nil {
		t.Fatal(err)
	}
	r := startAgent(t, e.args("--keep-on-exit"), nil)
	eventually(t, 5*time.Second, "ready", r.a.Guard.Ready)
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	if err := r.a.Guard.Ready(); err != nil {
		t.Errorf("--keep-on-exit removed something: %v", err)
	}
	if _, err := os.Stat(filepath.Join(e.runDir, agentsock.SocketName)); err == nil {
		t.Error("socket left behind")
	}
}

func TestParseFlags(t *testing.T) {
	for _, tc := range []struct {
		name    string
		args    []string
		env     map[string]string
		wantErr string
		check   func(*Config) error
	}{
		{name: "defaults", check: func(c *Config) error {
			if c.CNIBinDir != "/opt/cni/bin" || c.CNIConfDir != "/etc/cni/net.d" || c.RunDir != "/var/run/meshcni" || !c.Chained ||
				c.HealthAddr != "127.0.0.1:9807" || c.PluginBinary != "/opt/meshcni/bin/meshcni" || c.KubeconfigPath() != "/var/run/meshcni/meshcni-kubeconfig" {
				return fmt.Errorf("%+v", c)
			}
			return nil
		}},
		{name: "env", env: map[string]string{"MESHCNI_CNI_BIN_DIR": "/home/kubernetes/bin", "MESHCNI_CHAINED": "false", "MESHCNI_EXCLUDE_NAMESPACES": "kube-system, istio-system"},
			check: func(c *Config) error {
				if c.CNIBinDir != "/home/kubernetes/bin" || c.Chained || len(c.ExcludeNamespaces) != 2 || c.Entry().Kubernetes.CNIBinDir != "/home/kubernetes/bin" {
					return fmt.Errorf("%+v", c)
				}
				return nil
			}},
		{name: "flag beats env", args: []string{"--cni-bin-dir", "/a"}, env: map[string]string{"MESHCNI_CNI_BIN_DIR": "/b"},
			check: func(c *Config) error {
				if c.CNIBinDir != "/a" {
					return fmt.Errorf("%s", c.CNIBinDir)
				}
				return nil
			}},
		{name: "relative dir", args: []string{"--cni-bin-dir", "opt/cni"}, wantErr: "--cni-bin-dir \"opt/cni\": want an absolute path"},
		{name: "bad env bool", env: map[string]string{"MESHCNI_CHAINED": "yes please"}, wantErr: "MESHCNI_CHAINED"},
		{name: "bad duration", args: []string{"--debounce", "fast"}, wantErr: "debounce"},
		{name: "negative resync", args: []string{"--resync", "-1s"}, wantErr: "--resync"},
		{name: "bad level", args: []string{"--log-level", "loud"}, wantErr: "--log-level"},
		{name: "bad plugin level", args: []string{"--plugin-log-level", "loud"}, wantErr: "plugin_log_level"},
		{name: "bad backend", args: []string{"--backend", "ebpf"}, wantErr: "backend"},
		{name: "bad namespace", args: []string{"--exclude-namespaces", "Kube_System"}, wantErr: "exclude_namespaces"},
		{name: "bad addr", args: []string{"--health-addr", "8000"}, wantErr: "--health-addr"},
		{name: "bad port", args: []string{"--health-addr", ":99999"}, wantErr: "bad port"},
		{name: "conf file with path", args: []string{"--cni-conf-file-name", "../x.conflist"}, wantErr: "plain file name"},
		{name: "conf file ext", args: []string{"--cni-conf-file-name", "x.yaml"}, wantErr: ".conf, .conflist or .json"},
		{name: "network name", env: map[string]string{"MESHCNI_CHAINED": "false", "MESHCNI_NETWORK_NAME": "istio-cni"},
			check: func(c *Config) error {
				if c.NetworkName != "istio-cni" {
					return fmt.Errorf("network name %q", c.NetworkName)
				}
				return nil
			}},
		{name: "bad network name", args: []string{"--network-name", "istio cni"}, wantErr: `--network-name "istio cni": want a CNI network name`},
		{name: "stray argument", args: []string{"install"}, wantErr: "unexpected arguments"},
		{name: "unknown flag", args: []string{"--nope"}, wantErr: "unknown flag: --nope"},
		{name: "Go-style single-dash flags", args: []string{"-cni-bin-dir", "/a", "-chained=false", "-keep-on-exit"}, env: map[string]string{"MESHCNI_CNI_BIN_DIR": "/b"},
			check: func(c *Config) error {
				if c.CNIBinDir != "/a" || c.Chained || c.KeepOnExit != KeepAlways {
					return fmt.Errorf("%+v", c)
				}
				return nil
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var usage bytes.Buffer
			c, err := ParseFlags(tc.args, func(k string) string { return tc.env[k] }, &usage)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if err := tc.check(c); err != nil {
				t.Error(err)
			}
		})
	}
}

func TestMainExitCodes(t *testing.T) {
	var stderr bytes.Buffer
	if code := Main([]string{"--backend", "ebpf"}, func(string) string { return "" }, &stderr); code != 2 || !strings.Contains(stderr.String(), "backend") {
		t.Errorf("bad flag: code %d, %q", code, stderr.String())
	}
	stderr.Reset()
	// Outside a pod without --kubeconfig-source: a clear message.
	if code := Main([]string{"--health-addr", "127.0.0.1:0"}, func(string) string { return "" }, &stderr); code != 2 || !strings.Contains(stderr.String(), "--kubeconfig-source") {
		t.Errorf("outside a pod: code %d, %q", code, stderr.String())
	}
}
