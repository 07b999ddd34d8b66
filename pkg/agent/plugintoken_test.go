package agent

import (
	"bytes"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes/fake"
)

func TestRenewAfter(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		life     time.Duration
		r        float64
		min, max time.Duration
	}{
		{time.Hour, 0, 48 * time.Minute, 48 * time.Minute},                    // 80 %
		{time.Hour, 0.999999, 42 * time.Minute, 42*time.Minute + time.Second}, // 70 %
		{time.Hour, 0.5, 45 * time.Minute, 45 * time.Minute},
		{10 * time.Minute, 0, 8 * time.Minute, 8 * time.Minute}, // the API server's minimum
		{0, 0.5, time.Second, time.Second},                      // an expired token: at once (1 s)
		{-time.Hour, 0, time.Second, time.Second},
	} {
		got := RenewAfter(t0, t0.Add(tc.life), tc.r)
		if got < tc.min || got > tc.max {
			t.Errorf("RenewAfter(life %v, r %v) = %v, want in [%v, %v]", tc.life, tc.r, got, tc.min, tc.max)
		}
	}
}

func TestRetryAfter(t *testing.T) {
	for _, tc := range []struct {
		attempt int
		base    time.Duration
	}{{1, time.Second}, {2, 2 * time.Second}, {3, 4 * time.Second}, {6, 32 * time.Second}, {7, time.Minute}, {50, time.Minute}} {
		lo, hi := RetryAfter(tc.attempt, 0), RetryAfter(tc.attempt, 0.999999)
		if want := time.Duration(float64(tc.base) * 0.8); lo != want {
			t.Errorf("RetryAfter(%d, 0) = %v, want %v", tc.attempt, lo, want)
		}
		if hi < time.Duration(float64(tc.base)*1.19) || hi > time.Duration(float64(tc.base)*1.2) {
			t.Errorf("RetryAfter(%d, 1) = %v, want 1.2 × %v", tc.attempt, hi, tc.base)
		}
	}
}

func TestPluginTokenFlags(t *testing.T) {
	base := []string{"--kubeconfig-source", "/k"}
	cfg, err := ParseFlags(base, func(string) string { return "" }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.PluginServiceAccount != "meshcni-plugin" || cfg.PluginTokenExpiration != time.Hour {
		t.Errorf("defaults: %q %v", cfg.PluginServiceAccount, cfg.PluginTokenExpiration)
	}
	env := map[string]string{"MESHCNI_PLUGIN_SERVICE_ACCOUNT": "rel-plugin", "MESHCNI_PLUGIN_TOKEN_EXPIRATION": "15m"}
	cfg, err = ParseFlags(base, func(k string) string { return env[k] }, io.Discard)
	if err != nil || cfg.PluginServiceAccount != "rel-plugin" || cfg.PluginTokenExpiration != 15*time.Minute {
		t.Errorf("from env: %+v %v", cfg, err)
	}
	cfg, err = ParseFlags(append(base, "--plugin-service-account="), func(string) string { return "" }, io.Discard)
	if err != nil || cfg.PluginServiceAccount != "" {
		t.Errorf("explicitly empty: %q %v", cfg.PluginServiceAccount, err)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--plugin-token-expiration", "9m59s"}, "want 10m0s to 24h0m0s"},
		{[]string{"--plugin-token-expiration", "24h0m1s"}, "want 10m0s to 24h0m0s"},
		{[]string{"--plugin-token-expiration", "720h"}, "--plugin-token-expiration"},
		{[]string{"--plugin-service-account", "Not_A_Name"}, "--plugin-service-account"},
	} {
		if _, err := ParseFlags(append(base, tc.args...), func(string) string { return "" }, io.Discard); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v, want an error naming %q", tc.args, err, tc.want)
		}
	}
}

// TestPluginCredentialChoice: in a pod, the plugin gets its own minted token; that needs
// API access and the node, else New fails naming the way out; an explicitly empty
// --plugin-service-account hands over the agent's own token with a warning.
func TestPluginCredentialChoice(t *testing.T) {
	e := newEnv(t)
	getenv := func(k string) string {
		return map[string]string{"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}[k]
	}
	args := e.args("--kubeconfig-source", "", "--pod-namespace", "meshcni-system", "--node-name", "node-1")
	cfg, err := ParseFlags(args, getenv, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	var log bytes.Buffer
	_, err = New(cfg, slog.New(slog.NewTextHandler(&log, nil)), Options{Getenv: getenv})
	if err == nil || !strings.Contains(err.Error(), "no API access") || !strings.Contains(err.Error(), "--plugin-service-account=") {
		t.Errorf("no API access: %v", err)
	}
	a, err := New(cfg, slog.New(slog.NewTextHandler(&log, nil)), Options{Getenv: getenv, Kube: &Kube{Client: fake.NewClientset()}})
	if err != nil {
		t.Fatal(err)
	}
	if a.PluginToken == nil || a.PluginToken.NodeName != "node-1" || a.PluginToken.Namespace != "meshcni-system" || a.PluginToken.ServiceAccount != "meshcni-plugin" {
		t.Errorf("plugin token %+v", a.PluginToken)
	}
	cfg.PluginServiceAccount = ""
	log.Reset()
	a, err = New(cfg, slog.New(slog.NewTextHandler(&log, nil)), Options{Getenv: getenv})
	if err != nil || a.PluginToken != nil || !strings.Contains(log.String(), "the agent's own token") {
		t.Errorf("own token: %v, %+v, log %s", err, a, log.String())
	}
}
