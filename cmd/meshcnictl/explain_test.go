package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

const meshedPodYAML = `apiVersion: v1
kind: Pod
metadata:
  name: web
  namespace: app
  annotations:
    sidecar.istio.io/status: '{}'
    traffic.sidecar.istio.io/excludeOutboundPorts: "5432"
spec:
  containers:
  - name: app
    image: app
  - name: istio-proxy
    image: proxyv2
    args: [proxy, sidecar]
status:
  podIPs: [{ip: 10.0.0.5}, {ip: "fd00::5"}]
`

// dualStackPodYAML is meshedPodYAML with ISTIO_DUAL_STACK=true on istio-proxy.
var dualStackPodYAML = strings.Replace(meshedPodYAML, "    args: [proxy, sidecar]\n", "    args: [proxy, sidecar]\n    env: [{name: ISTIO_DUAL_STACK, value: \"true\"}]\n", 1)

func runExplain(t *testing.T, manifest string, extra ...string) (string, error) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "pod.yaml")
	if err := os.WriteFile(path, []byte(manifest), 0o600); err != nil {
		t.Fatal(err)
	}
	root := newRoot()
	var out bytes.Buffer
	root.SetOut(&out)
	root.SetArgs(append([]string{"explain", "-f", path}, extra...))
	err := root.Execute()
	return out.String(), err
}

func TestExplain(t *testing.T) {
	out, err := runExplain(t, meshedPodYAML)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"decision: redirected", "exclude 5432", "ipv4 true, ipv6 false (ipv6 mode istio: IPv6 passes uncaptured)", "-A ISTIO_OUTPUT", "# IPv6: no rule"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "# ip6tables-restore") {
		t.Errorf("dual-stack pod, single-stack proxy: IPv6 rules:\n%s", out)
	}
	out, err = runExplain(t, meshedPodYAML, "--exclude-namespaces", "app")
	if err != nil || !strings.Contains(out, "decision: not redirected") || !strings.Contains(out, "namespace app is excluded") {
		t.Fatalf("%v\n%s", err, out)
	}
	bad := strings.Replace(meshedPodYAML, `"5432"`, `"54x"`, 1)
	_, err = runExplain(t, bad)
	if err == nil || !strings.Contains(err.Error(), `traffic.sidecar.istio.io/excludeOutboundPorts "54x"`) {
		t.Fatalf("bad annotation: %v", err)
	}
}

func TestExplainArgs(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"explain"}, "give a pod"},
		{[]string{"explain", "-f", "x.yaml", "web"}, "either -f or a pod name"},
		{[]string{"explain", "--kubeconfig", "/nonexistent/kubeconfig", "app/Web"}, `pod name "Web"`},
		{[]string{"explain", "--kubeconfig", "/nonexistent/kubeconfig", "app/web"}, "kubeconfig /nonexistent/kubeconfig"},
	} {
		_, _, err := ctl(t, tc.args...)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: err %v, want %q", tc.args, err, tc.want)
		}
	}
}

// testExplainAPI runs explain against the API server for the pods of
// TestInspectExplainTestbed (meshed, plain, broken) in namespace ns.
func testExplainAPI(t *testing.T, kubeconfig, ns string) {
	for _, tc := range []struct {
		pod  string
		args []string
		want []string
	}{
		{"meshed", []string{ns + "/meshed"}, []string{"pod:      " + ns + "/meshed", "decision: redirected", "exclude 5432", "ipv4 true, ipv6 false", "-A ISTIO_OUTPUT -d 10.214.0.0/16 -j RETURN", "-A ISTIO_INBOUND"}},
		{"plain", []string{"-n", ns, "plain"}, []string{"decision: not redirected", "reason:   no istio-proxy container"}},
		// explain says what the annotations ask for; the broken pod's live rules do
		// not change that (inspect shows the drift).
		{"broken", []string{ns + "/broken"}, []string{"decision: redirected", "-A ISTIO_INBOUND -p tcp --dport 15008 -j RETURN"}},
		{"excluded namespace", []string{"--exclude-namespaces", ns, ns + "/meshed"}, []string{"decision: not redirected", "namespace " + ns + " is excluded"}},
	} {
		t.Run("explain "+tc.pod, func(t *testing.T) {
			out, code, err := ctl(t, append([]string{"explain", "--kubeconfig", kubeconfig}, tc.args...)...)
			if code != 0 || err != nil {
				t.Fatalf("exit %d, %v:\n%s", code, err, out)
			}
			t.Logf("meshcnictl explain %s:\n%s", strings.Join(tc.args, " "), out)
			for _, w := range tc.want {
				if !strings.Contains(out, w) {
					t.Errorf("output lacks %q:\n%s", w, out)
				}
			}
			if strings.Contains(out, "# ip6tables-restore") {
				t.Errorf("IPv4-only pod, IPv6 rules:\n%s", out)
			}
		})
	}
}

// IP families: --pod-ip wins over the status; the status is status.podIPs, else
// status.podIP; a bad address is named with where it came from.
func TestExplainFamilies(t *testing.T) {
	v6only := strings.Replace(meshedPodYAML, `podIPs: [{ip: 10.0.0.5}, {ip: "fd00::5"}]`, `podIP: "fd00::5"`, 1)
	badStatus := strings.Replace(meshedPodYAML, `{ip: 10.0.0.5}`, `{ip: 10.0.0.500}`, 1)
	for _, tc := range []struct {
		name, manifest string
		extra          []string
		want, wantErr  string
	}{
		{"podIPs, single-stack proxy", meshedPodYAML, nil, "ipv4 true, ipv6 false (ipv6 mode istio", ""},
		{"podIPs, ISTIO_DUAL_STACK", dualStackPodYAML, nil, "ipv4 true, ipv6 true (ipv6 mode istio)", ""},
		{"--ipv6-mode capture", meshedPodYAML, []string{"--ipv6-mode", "capture"}, "ipv4 true, ipv6 true (ipv6 mode capture)", ""},
		{"--ipv6-mode drop", meshedPodYAML, []string{"--ipv6-mode", "drop"}, "ipv6 false (ipv6 mode drop: IPv6 dropped", ""},
		{"annotation wins over --ipv6-mode", strings.Replace(meshedPodYAML, "    sidecar.istio.io/status: '{}'\n", "    sidecar.istio.io/status: '{}'\n    meshcni.io/ipv6: capture\n", 1),
			[]string{"--ipv6-mode", "drop"}, "ipv6 true (ipv6 mode capture)", ""},
		{"bad --ipv6-mode", meshedPodYAML, []string{"--ipv6-mode", "pass"}, "", `invalid --ipv6-mode "pass": want istio, capture or drop`},
		{"bad annotation", strings.Replace(meshedPodYAML, "    sidecar.istio.io/status: '{}'\n", "    sidecar.istio.io/status: '{}'\n    meshcni.io/ipv6: pass\n", 1),
			nil, "", `invalid meshcni.io/ipv6 "pass": want istio, capture or drop`},
		{"podIP only", v6only, nil, "ipv4 false, ipv6 true", ""},
		{"--pod-ip wins", dualStackPodYAML, []string{"--pod-ip", "10.0.0.5"}, "ipv4 true, ipv6 false", ""},
		{"--pod-ip wins over a bad status", badStatus, []string{"--pod-ip", "fd00::5"}, "ipv4 false, ipv6 true", ""},
		{"bad --pod-ip", meshedPodYAML, []string{"--pod-ip", "10.0.0.x"}, "", `--pod-ip "10.0.0.x": not an IP address`},
		{"bad status IP", badStatus, nil, "", `bad IP "10.0.0.500" in status`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, err := runExplain(t, tc.manifest, tc.extra...)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil || !strings.Contains(out, tc.want) {
				t.Fatalf("err %v, output lacks %q:\n%s", err, tc.want, out)
			}
		})
	}
}
