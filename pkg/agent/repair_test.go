package agent

import (
	"bytes"
	"log/slog"
	"reflect"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/meshcni/meshcni/pkg/podnetns"
	"github.com/meshcni/meshcni/pkg/repair"
	"github.com/meshcni/meshcni/pkg/spec"
)

func TestRepairFlags(t *testing.T) {
	for _, tc := range []struct {
		name    string
		args    []string
		env     map[string]string
		wantErr string
		check   func(*testing.T, *Config)
	}{
		{name: "defaults", check: func(t *testing.T, c *Config) {
			if !c.Repair || c.RepairAction != repair.ActionRepair || c.RepairLabelKey != "cni.istio.io/uninitialized" ||
				c.RepairInitContainer != "istio-validation" || c.RepairExitCode != 126 || c.RepairMessage != "" ||
				c.RepairLabelSelector != "" || c.RepairFieldSelector != "" || !reflect.DeepEqual(c.RepairNetnsDirs, podnetns.DefaultNetnsDirs) {
				t.Fatalf("%+v", c)
			}
			p, err := c.RepairPolicy()
			if err != nil || p.LabelSelector != nil || p.FieldSelector != nil || p.Criteria.Message != nil || p.Criteria.ExitCode != 126 {
				t.Fatalf("policy %+v, %v", p, err)
			}
		}},
		{name: "env", env: map[string]string{
			"MESHCNI_REPAIR": "false", "MESHCNI_REPAIR_ACTION": "label", "MESHCNI_REPAIR_LABEL_KEY": "example.com/broken",
			"MESHCNI_REPAIR_LABEL_SELECTOR": "app in (web),!canary", "MESHCNI_REPAIR_FIELD_SELECTOR": "metadata.namespace!=batch",
			"MESHCNI_REPAIR_INIT_CONTAINER_NAME": "check", "MESHCNI_REPAIR_EXIT_CODE": "3", "MESHCNI_REPAIR_MESSAGE": "^no redirect",
			"MESHCNI_REPAIR_NETNS_DIRS": "/run/netns/, /var/run/docker/netns",
		}, check: func(t *testing.T, c *Config) {
			if c.Repair || c.RepairAction != repair.ActionLabel || c.RepairLabelKey != "example.com/broken" || c.RepairInitContainer != "check" ||
				c.RepairExitCode != 3 || !reflect.DeepEqual(c.RepairNetnsDirs, []string{"/run/netns", "/var/run/docker/netns"}) {
				t.Fatalf("%+v", c)
			}
			p, err := c.RepairPolicy()
			if err != nil || p.LabelSelector.String() != "app in (web),!canary" || p.FieldSelector.String() != "metadata.namespace!=batch" ||
				p.Criteria.Message.String() != "^no redirect" || p.Criteria.ExitCode != 3 || p.Criteria.InitContainer != "check" {
				t.Fatalf("policy %+v, %v", p, err)
			}
		}},
		{name: "flag beats env", args: []string{"--repair-action", "delete"}, env: map[string]string{"MESHCNI_REPAIR_ACTION": "label"},
			check: func(t *testing.T, c *Config) {
				if c.RepairAction != repair.ActionEvict {
					t.Fatal(c.RepairAction)
				}
			}},
		{name: "no netns dirs", args: []string{"--repair-netns-dirs", ""}, check: func(t *testing.T, c *Config) {
			if c.RepairNetnsDirs == nil || len(c.RepairNetnsDirs) != 0 {
				t.Fatalf("%#v: want an empty, non-nil list (only /proc)", c.RepairNetnsDirs)
			}
		}},
		{name: "bad action", args: []string{"--repair-action", "restart"}, wantErr: `--repair-action: repair action: unknown action "restart"`},
		{name: "bad label key", args: []string{"--repair-label-key", "not a key"}, wantErr: "--repair-label-key"},
		{name: "bad label selector", args: []string{"--repair-label-selector", "app=("}, wantErr: "--repair-label-selector"},
		{name: "bad field selector", args: []string{"--repair-field-selector", "metadata.labels=x"}, wantErr: `--repair-field-selector: field selector "metadata.labels=x": field "metadata.labels" is not a pod field`},
		{name: "bad container", args: []string{"--repair-init-container-name", "Istio_Validation"}, wantErr: "--repair-init-container-name"},
		{name: "exit code 0", args: []string{"--repair-exit-code", "0"}, wantErr: "--repair-exit-code: exit code 0: want 1 to 255"},
		{name: "exit code not a number", env: map[string]string{"MESHCNI_REPAIR_EXIT_CODE": "x"}, wantErr: "MESHCNI_REPAIR_EXIT_CODE"},
		{name: "bad message", args: []string{"--repair-message", "(["}, wantErr: "--repair-message"},
		{name: "relative netns dir", args: []string{"--repair-netns-dirs", "/run/netns,netns"}, wantErr: `--repair-netns-dirs: "netns": want an absolute path`},
		{name: "bad repair bool", env: map[string]string{"MESHCNI_REPAIR": "sometimes"}, wantErr: "MESHCNI_REPAIR"},
		// The IPv6 mode: the plugin entry's ipv6 key and the repair controller's, one setting.
		{name: "ipv6 default", check: func(t *testing.T, c *Config) {
			p, err := c.RepairPolicy()
			if err != nil || c.IPv6 != spec.IPv6Istio || p.Mesh.IPv6 != spec.IPv6Istio || c.Entry().IPv6 != "" {
				t.Fatalf("ipv6 %q, repair %q, entry %q, %v", c.IPv6, p.Mesh.IPv6, c.Entry().IPv6, err)
			}
		}},
		{name: "ipv6 drop", env: map[string]string{"MESHCNI_IPV6": "drop", "MESHCNI_POD_NAMESPACE": "meshcni-system"}, check: func(t *testing.T, c *Config) {
			p, err := c.RepairPolicy()
			if err != nil || p.Mesh.IPv6 != spec.IPv6Drop || c.Entry().IPv6 != "drop" || p.Mesh.AgentNamespace != "meshcni-system" {
				t.Fatalf("ipv6 %q, repair %+v, entry %q, %v", c.IPv6, p.Mesh, c.Entry().IPv6, err)
			}
		}},
		{name: "bad ipv6", args: []string{"--ipv6", "pass"}, wantErr: `--ipv6`},
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

// TestAddRepair: the controller runs only with API access and a node name, and says
// why it is off otherwise; when on, its metric is in the agent's registry.
func TestAddRepair(t *testing.T) {
	kube := NewKubeFor(fake.NewClientset(), "node-a")
	defer kube.Stop()
	for _, tc := range []struct {
		name    string
		args    []string
		kube    *Kube
		on      bool
		wantLog string
	}{
		{name: "on", args: []string{"--node-name", "node-a"}, kube: kube, on: true, wantLog: ""},
		{name: "disabled", args: []string{"--node-name", "node-a", "--repair=false"}, kube: kube, wantLog: "repair controller off (--repair=false)"},
		{name: "no API access", args: []string{"--node-name", "node-a"}, wantLog: "repair controller off: no Kubernetes API access"},
		{name: "no node name", kube: kube, wantLog: "repair controller off: no --node-name"},
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
			if err := a.AddRepair(tc.kube); err != nil {
				t.Fatal(err)
			}
			added := len(a.runnables) - n
			if tc.on {
				if added != 1 || a.runnables[len(a.runnables)-1].Name() != "repair" {
					t.Fatalf("runnables added: %d", added)
				}
				if c, err := testutil.GatherAndCount(a.Metrics.Registry, "meshcni_repairs_total"); err != nil || c != 3 {
					t.Fatalf("meshcni_repairs_total series %d (%v), want success, error and refused of action repair", c, err)
				}
				return
			}
			if added != 0 || !strings.Contains(logs.String(), tc.wantLog) {
				t.Fatalf("added %d, logs %q, want %q", added, logs.String(), tc.wantLog)
			}
		})
	}
}
