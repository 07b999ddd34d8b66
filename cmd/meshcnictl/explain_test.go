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
	for _, want := range []string{"decision: redirected", "exclude 5432", "ipv4 true, ipv6 true", "-A ISTIO_OUTPUT", "# ip6tables-restore"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
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
