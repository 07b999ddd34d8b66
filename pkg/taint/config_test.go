package taint

import (
	"bytes"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"
)

func TestParseFlags(t *testing.T) {
	for _, tc := range []struct {
		name    string
		env     map[string]string
		args    []string
		wantErr string
		check   func(t *testing.T, c *Config)
	}{
		{name: "defaults from POD_NAMESPACE", env: map[string]string{"POD_NAMESPACE": "istio-system"}, check: func(t *testing.T, c *Config) {
			if c.AgentNamespace != "istio-system" || c.LeaseNamespace != "istio-system" || c.LeaseName != "meshcni-taint-controller" {
				t.Errorf("namespaces/lease: %+v", c)
			}
			if c.AgentSelector.String() != "app.kubernetes.io/component=agent,app.kubernetes.io/name=meshcni" || !c.NodeSelector.Empty() {
				t.Errorf("selectors %q %q", c.AgentSelector, c.NodeSelector)
			}
			if !c.TaintNewNodes || c.GracePeriod != 30*time.Second || !c.LeaderElect || c.HealthAddr != ":9808" || c.Workers != 4 {
				t.Errorf("defaults: %+v", c)
			}
			if c.TaintMode != Joining || c.MaxTaintedFraction != 0.1 || c.MaxTaintedFloor != 1 {
				t.Errorf("breaker defaults: mode %s, fraction %v, floor %d; want joining, 0.1, 1", c.TaintMode, c.MaxTaintedFraction, c.MaxTaintedFloor)
			}
			if !strings.Contains(c.Identity, "_") || len(c.Identity) < 10 {
				t.Errorf("identity %q: want host_random", c.Identity)
			}
		}},
		{name: "MESHCNI_ env beats POD_NAMESPACE, flag beats env",
			env:  map[string]string{"POD_NAMESPACE": "a", "MESHCNI_AGENT_NAMESPACE": "b", "MESHCNI_GRACE_PERIOD": "5s", "MESHCNI_TAINT_NEW_NODES": "false"},
			args: []string{"--agent-namespace", "c", "--node-selector", "role=mesh,!edge", "--identity", "me"},
			check: func(t *testing.T, c *Config) {
				if c.AgentNamespace != "c" || c.LeaseNamespace != "a" || c.GracePeriod != 5*time.Second || c.TaintNewNodes || c.Identity != "me" {
					t.Errorf("got %+v", c)
				}
				if c.NodeSelector.String() != "!edge,role=mesh" {
					t.Errorf("node selector %q", c.NodeSelector)
				}
			}},
		{name: "no leader election needs no lease namespace", args: []string{"--agent-namespace", "x", "--leader-elect=false"}, check: func(t *testing.T, c *Config) {
			if c.LeaderElect || c.Identity != "" {
				t.Errorf("got %+v", c)
			}
		}},
		{name: "Go-style single-dash flags", args: []string{"-agent-namespace", "x", "-leader-elect=false", "-grace-period", "1s"}, check: func(t *testing.T, c *Config) {
			if c.AgentNamespace != "x" || c.LeaderElect || c.GracePeriod != time.Second {
				t.Errorf("got %+v", c)
			}
		}},
		{name: "taint mode and limits from env and flags",
			env:  map[string]string{"POD_NAMESPACE": "x", "MESHCNI_TAINT_MODE": "always", "MESHCNI_MAX_TAINTED_FRACTION": "0.25"},
			args: []string{"--max-tainted-floor", "3"},
			check: func(t *testing.T, c *Config) {
				if c.TaintMode != Always || c.MaxTaintedFraction != 0.25 || c.MaxTaintedFloor != 3 || c.Policy().Mode != Always {
					t.Errorf("got mode %s, fraction %v, floor %d", c.TaintMode, c.MaxTaintedFraction, c.MaxTaintedFloor)
				}
			}},
		{name: "remove only (0 and 0)", env: map[string]string{"POD_NAMESPACE": "x"}, args: []string{"--max-tainted-fraction", "0", "--max-tainted-floor", "0"}, check: func(t *testing.T, c *Config) {
			if Limit(1000, c.MaxTaintedFraction, c.MaxTaintedFloor) != 0 {
				t.Errorf("limit %d", Limit(1000, c.MaxTaintedFraction, c.MaxTaintedFloor))
			}
		}},
		{name: "bad taint mode", env: map[string]string{"POD_NAMESPACE": "x"}, args: []string{"--taint-mode", "never"}, wantErr: `--taint-mode "never": want joining or always`},
		{name: "fraction above 1", env: map[string]string{"POD_NAMESPACE": "x"}, args: []string{"--max-tainted-fraction", "1.5"}, wantErr: "--max-tainted-fraction 1.5: want 0 to 1"},
		{name: "negative fraction", env: map[string]string{"POD_NAMESPACE": "x", "MESHCNI_MAX_TAINTED_FRACTION": "-0.1"}, wantErr: "--max-tainted-fraction -0.1: want 0 to 1"},
		{name: "NaN fraction", env: map[string]string{"POD_NAMESPACE": "x"}, args: []string{"--max-tainted-fraction", "NaN"}, wantErr: "--max-tainted-fraction NaN"},
		{name: "percent fraction", env: map[string]string{"POD_NAMESPACE": "x"}, args: []string{"--max-tainted-fraction", "10%"}, wantErr: `invalid argument "10%"`},
		{name: "negative floor", env: map[string]string{"POD_NAMESPACE": "x"}, args: []string{"--max-tainted-floor", "-1"}, wantErr: "--max-tainted-floor -1: want 0 or more"},
		{name: "no namespace", wantErr: "--agent-namespace: empty"},
		{name: "no lease namespace", args: []string{"--agent-namespace", "x"}, wantErr: "--lease-namespace: empty"},
		{name: "bad agent selector", env: map[string]string{"POD_NAMESPACE": "x"}, args: []string{"--agent-selector", "app in (a"}, wantErr: `--agent-selector "app in (a"`},
		{name: "empty agent selector", env: map[string]string{"POD_NAMESPACE": "x"}, args: []string{"--agent-selector", ""}, wantErr: "--agent-selector: empty"},
		{name: "bad node selector", env: map[string]string{"POD_NAMESPACE": "x"}, args: []string{"--node-selector", "a==b==c"}, wantErr: `--node-selector "a==b==c"`},
		{name: "bad duration flag", env: map[string]string{"POD_NAMESPACE": "x"}, args: []string{"--grace-period", "soon"}, wantErr: `invalid argument "soon" for "--grace-period" flag`},
		{name: "bad duration env", env: map[string]string{"POD_NAMESPACE": "x", "MESHCNI_GRACE_PERIOD": "30"}, wantErr: `MESHCNI_GRACE_PERIOD="30"`},
		{name: "negative grace", env: map[string]string{"POD_NAMESPACE": "x"}, args: []string{"--grace-period", "-1s"}, wantErr: "--grace-period -1s: want 0 or more"},
		{name: "lease shorter than renew", env: map[string]string{"POD_NAMESPACE": "x"}, args: []string{"--lease-duration", "10s"}, wantErr: "--lease-duration 10s: want more than --renew-deadline"},
		{name: "lease in whole seconds not longer than renew", env: map[string]string{"POD_NAMESPACE": "x"}, args: []string{"--lease-duration", "10.9s"}, wantErr: "--lease-duration 10.9s: want more than --renew-deadline (10s) in whole seconds (the Lease records 10s)"},
		{name: "renew vs retry", env: map[string]string{"POD_NAMESPACE": "x"}, args: []string{"--retry-period", "9s"}, wantErr: "--renew-deadline 10s: want more than 1.2"},
		{name: "bad lease name", env: map[string]string{"POD_NAMESPACE": "x"}, args: []string{"--lease-name", "Bad_Name"}, wantErr: `--lease-name "Bad_Name"`},
		{name: "bad namespace", args: []string{"--agent-namespace", "Not/A/Namespace", "--leader-elect=false"}, wantErr: `--agent-namespace "Not/A/Namespace"`},
		{name: "bad workers", env: map[string]string{"POD_NAMESPACE": "x"}, args: []string{"--workers", "0"}, wantErr: "--workers 0"},
		{name: "bad health addr", env: map[string]string{"POD_NAMESPACE": "x"}, args: []string{"--health-addr", "9808"}, wantErr: `--health-addr "9808"`},
		{name: "bad log level", env: map[string]string{"POD_NAMESPACE": "x"}, args: []string{"--log-level", "loud"}, wantErr: `--log-level "loud"`},
		{name: "bad log format", env: map[string]string{"POD_NAMESPACE": "x"}, args: []string{"--log-format", "logfmt"}, wantErr: `--log-format "logfmt": want json or text`},
		{name: "stray argument", env: map[string]string{"POD_NAMESPACE": "x"}, args: []string{"run"}, wantErr: "unexpected arguments"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := ParseFlags(tc.args, func(k string) string { return tc.env[k] }, io.Discard)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("error %v, want one containing %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			tc.check(t, c)
		})
	}
}

// TestMainExitCodes: --help exits 0 and documents every flag with its variable; bad
// settings exit 2 with a message naming the flag, before any API access.
func TestMainExitCodes(t *testing.T) {
	var out bytes.Buffer
	if code := Main([]string{"--help"}, func(string) string { return "" }, &out); code != 0 {
		t.Fatalf("--help exit %d", code)
	}
	for _, want := range []string{TaintKey + ":NoSchedule", "[$MESHCNI_GRACE_PERIOD]", "[$MESHCNI_AGENT_SELECTOR]", "[$MESHCNI_TAINT_MODE]", "[$MESHCNI_MAX_TAINTED_FRACTION]", "--max-tainted-floor", "--grace-period", "docs/taint.md"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("--help lacks %q:\n%s", want, out.String())
		}
	}
	if _, err := ParseFlags([]string{"-h"}, func(string) string { return "" }, io.Discard); !errors.Is(err, pflag.ErrHelp) {
		t.Errorf("-h: %v", err)
	}
	for _, tc := range []struct {
		args []string
		env  map[string]string
		msg  string
	}{
		{[]string{"--node-selector", "x in ("}, map[string]string{"POD_NAMESPACE": "ns"}, "--node-selector"},
		{nil, map[string]string{"POD_NAMESPACE": "ns", "MESHCNI_RENEW_DEADLINE": "ten"}, "MESHCNI_RENEW_DEADLINE"},
		{[]string{"--kubeconfig", "/nonexistent/kubeconfig"}, map[string]string{"POD_NAMESPACE": "ns"}, "--kubeconfig /nonexistent/kubeconfig"},
	} {
		out.Reset()
		code := Main(tc.args, func(k string) string { return tc.env[k] }, &out)
		if code != 2 || !strings.Contains(out.String(), tc.msg) || !strings.HasPrefix(out.String(), Component+": ") {
			t.Errorf("Main(%q) = %d, %q; want 2 and a message naming %s", tc.args, code, out.String(), tc.msg)
		}
	}
}
