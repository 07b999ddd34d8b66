package agent

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/meshcni/meshcni/pkg/audit"
	"github.com/meshcni/meshcni/pkg/heal"
)

func TestAuditFlags(t *testing.T) {
	for _, tc := range []struct {
		name    string
		args    []string
		env     map[string]string
		wantErr string
		check   func(*testing.T, *Config)
	}{
		{name: "defaults", check: func(t *testing.T, c *Config) {
			if c.AuditPeriod != time.Minute || c.AuditAction != audit.ActionRepair || c.AuditEscapedAction != audit.ActionRepair ||
				c.AuditConcurrency != 4 || c.AuditFollowAnnotations ||
				c.HealLimits != (heal.Limits{MaxEvictions: 3, Window: 10 * time.Minute, MaxFraction: 0.1}) {
				t.Fatalf("%+v", c)
			}
		}},
		{name: "env", env: map[string]string{
			"MESHCNI_AUDIT_PERIOD": "5m", "MESHCNI_AUDIT_ACTION": "report", "MESHCNI_AUDIT_ESCAPED_ACTION": "repair",
			"MESHCNI_AUDIT_CONCURRENCY": "2", "MESHCNI_AUDIT_FOLLOW_ANNOTATIONS": "true",
		}, check: func(t *testing.T, c *Config) {
			if c.AuditPeriod != 5*time.Minute || c.AuditAction != audit.ActionReport || c.AuditEscapedAction != audit.ActionRepair ||
				c.AuditConcurrency != 2 || !c.AuditFollowAnnotations {
				t.Fatalf("%+v", c)
			}
		}},
		{name: "off", args: []string{"--audit-period", "0"}, check: func(t *testing.T, c *Config) {
			if c.AuditPeriod != 0 {
				t.Fatal(c.AuditPeriod)
			}
		}},
		{name: "flag beats env", args: []string{"--audit-escaped-action", "report"}, env: map[string]string{"MESHCNI_AUDIT_ESCAPED_ACTION": "repair"},
			check: func(t *testing.T, c *Config) {
				if c.AuditEscapedAction != audit.ActionReport {
					t.Fatal(c.AuditEscapedAction)
				}
			}},
		{name: "delete is evict", args: []string{"--audit-escaped-action", "delete"}, check: func(t *testing.T, c *Config) {
			if c.AuditEscapedAction != audit.ActionEvict {
				t.Fatal(c.AuditEscapedAction)
			}
		}},
		{name: "heal budget", args: []string{"--heal-max-evictions", "5", "--heal-eviction-window", "1h", "--heal-max-evict-fraction", "0.5"}, check: func(t *testing.T, c *Config) {
			if c.HealLimits != (heal.Limits{MaxEvictions: 5, Window: time.Hour, MaxFraction: 0.5}) {
				t.Fatal(c.HealLimits)
			}
		}},
		{name: "heal budget 0", args: []string{"--heal-max-evictions", "0"}, wantErr: "--heal-max-evictions 0"},
		{name: "heal fraction above 1", args: []string{"--heal-max-evict-fraction", "2"}, wantErr: "max evict fraction 2"},
		{name: "evict is for escaped pods only", args: []string{"--audit-action", "evict"}, wantErr: `--audit-action: audit action: unknown action "evict": want repair, report`},
		{name: "bad escaped action", args: []string{"--audit-escaped-action", "label"}, wantErr: `--audit-escaped-action: audit escaped-pod action: unknown action "label"`},
		{name: "negative period", args: []string{"--audit-period", "-1s"}, wantErr: "--audit-period -1s: want 0 (off) or a positive duration"},
		{name: "period too short", args: []string{"--audit-period", "10ms"}, wantErr: "--audit-period 10ms: want at least 1s"},
		{name: "concurrency 0", args: []string{"--audit-concurrency", "0"}, wantErr: "--audit-concurrency 0: want 1 to 64"},
		{name: "bad bool", env: map[string]string{"MESHCNI_AUDIT_FOLLOW_ANNOTATIONS": "maybe"}, wantErr: "MESHCNI_AUDIT_FOLLOW_ANNOTATIONS"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := ParseFlags(tc.args, func(k string) string { return tc.env[k] }, &bytes.Buffer{})
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want %q", err, tc.wantErr)
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

// TestAddAudit: the audit runs only with API access, a node name and a period, and
// says why it is off otherwise; when on, its metrics are in the agent's registry.
func TestAddAudit(t *testing.T) {
	kube := NewKubeFor(fake.NewClientset(), "node-a")
	defer kube.Stop()
	for _, tc := range []struct {
		name    string
		args    []string
		kube    *Kube
		on      bool
		wantLog string
	}{
		{name: "on", args: []string{"--node-name", "node-a"}, kube: kube, on: true},
		{name: "period 0", args: []string{"--node-name", "node-a", "--audit-period=0"}, kube: kube, wantLog: "audit off (--audit-period=0)"},
		{name: "no API access", args: []string{"--node-name", "node-a"}, wantLog: "audit off: no Kubernetes API access"},
		{name: "no node name", kube: kube, wantLog: "audit off: no --node-name"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := append([]string{"--run-dir", t.TempDir(), "--kubeconfig-source", "/dev/null"}, tc.args...)
			cfg, err := ParseFlags(args, func(string) string { return "" }, &bytes.Buffer{})
			if err != nil {
				t.Fatal(err)
			}
			var logs bytes.Buffer
			a, err := New(cfg, slog.New(slog.NewTextHandler(&logs, nil)), Options{Kube: tc.kube})
			if err != nil {
				t.Fatal(err)
			}
			n := len(a.runnables)
			if err := a.AddAudit(tc.kube); err != nil {
				t.Fatal(err)
			}
			added := len(a.runnables) - n
			if tc.on {
				if added != 1 || a.runnables[len(a.runnables)-1].Name() != "audit" {
					t.Fatalf("runnables added: %d", added)
				}
				// Every reason of both drift counters is exported from the start.
				want := 2 * len(audit.MetricReasons())
				if c, err := testutil.GatherAndCount(a.Metrics.Registry, "meshcni_drift_detected_total", "meshcni_drift_repaired_total"); err != nil || c != want {
					t.Fatalf("drift series %d (%v), want %d", c, err, want)
				}
				return
			}
			if added != 0 || !strings.Contains(logs.String(), tc.wantLog) {
				t.Fatalf("added %d, logs %q, want %q", added, logs.String(), tc.wantLog)
			}
		})
	}
}

// TestStartedContainers: the informer update that triggers a pod's audit.
func TestStartedContainers(t *testing.T) {
	running := func(id string) corev1.ContainerStatus {
		return corev1.ContainerStatus{Name: "app", ContainerID: id, State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}}
	}
	waiting := corev1.ContainerStatus{Name: "app", State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{}}}
	pod := func(phase corev1.PodPhase, st ...corev1.ContainerStatus) *corev1.Pod {
		return &corev1.Pod{Status: corev1.PodStatus{Phase: phase, ContainerStatuses: st}}
	}
	for _, tc := range []struct {
		name     string
		old, cur *corev1.Pod
		want     bool
	}{
		{"container starts", pod(corev1.PodPending, waiting), pod(corev1.PodRunning, running("c1")), true},
		{"container restarts", pod(corev1.PodRunning, running("c1")), pod(corev1.PodRunning, running("c2")), true},
		{"no change", pod(corev1.PodRunning, running("c1")), pod(corev1.PodRunning, running("c1")), false},
		{"stops", pod(corev1.PodRunning, running("c1")), pod(corev1.PodRunning, waiting), false},
		{"added running", nil, pod(corev1.PodRunning, running("c1")), true},
		{"not running", nil, pod(corev1.PodPending, waiting), false},
	} {
		if got := audit.StartedContainers(tc.old, tc.cur); got != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
}
