package helper

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/meshcni/meshcni/internal/standin/fakeapi"
	"github.com/meshcni/meshcni/pkg/podget"
)

func noEnv(string) string { return "" }

// TestHelperMain runs the helper's main against a fake API server: every outcome is
// one JSON podget.Result on stdout with the documented exit status.
func TestHelperMain(t *testing.T) {
	api := fakeapi.New(t, "tok")
	api.AddPod(testPod("app", "web", "1"))
	kc := api.Kubeconfig(t, filepath.Join(t.TempDir(), "kubeconfig"))
	// podget's argv passes every value as --flag=value: a value holding "=", spaces or
	// what looks like another flag is read whole.
	odd := filepath.Join(t.TempDir(), "a=b --name=x -namespace")
	if err := os.Mkdir(odd, 0o755); err != nil {
		t.Fatal(err)
	}
	kcOdd := api.Kubeconfig(t, filepath.Join(odd, "kubeconfig"))
	for _, tt := range []struct {
		name     string
		args     []string
		status   int // forced API status
		exit     int
		kind     string
		apiCode  int
		errPart  string
		wantsPod bool
	}{
		{name: "pod", args: []string{"--kubeconfig=" + kc, "--namespace=app", "--name=web"}, exit: 0, wantsPod: true},
		{name: "pod, the argv podget builds", args: []string{"--kubeconfig=" + kcOdd, "--namespace=app", "--name=web", "--timeout=1.5s"}, exit: 0, wantsPod: true},
		{name: "forbidden", args: []string{"--kubeconfig=" + kc, "--namespace=app", "--name=web", "--timeout=2s"}, status: 403, exit: 1, kind: podget.KindAPI, apiCode: 403, errPart: "forbidden"},
		{name: "not found within the timeout", args: []string{"--kubeconfig=" + kc, "--namespace=app", "--name=ghost", "--timeout=300ms"}, exit: 1, kind: podget.KindAPI, apiCode: 404, errPart: `pods "ghost" not found`},
		{name: "kubeconfig missing", args: []string{"--kubeconfig=/nonexistent/kc", "--namespace=app", "--name=web"}, exit: 1, kind: podget.KindKubeconfig, errPart: "read kubeconfig"},
		{name: "no kubeconfig flag", args: []string{"--namespace=app", "--name=web"}, exit: 2, kind: podget.KindUsage, errPart: "--kubeconfig is required"},
		{name: "no name", args: []string{"--kubeconfig=" + kc, "--namespace=app"}, exit: 2, kind: podget.KindUsage, errPart: "--name are required"},
		{name: "bad timeout", args: []string{"--kubeconfig=" + kc, "--namespace=app", "--name=web", "--timeout=-1s"}, exit: 2, kind: podget.KindUsage, errPart: "--timeout"},
		{name: "stray argument", args: []string{"--kubeconfig=" + kc, "--namespace=app", "--name=web", "extra"}, exit: 2, kind: podget.KindUsage, errPart: "unexpected arguments"},
		{name: "unknown flag", args: []string{"--kubeconfig=" + kc, "--bogus"}, exit: 2, kind: podget.KindUsage, errPart: "bogus"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			api.SetStatus(tt.status)
			defer api.SetStatus(0)
			var stdout, stderr bytes.Buffer
			code := Main(tt.args, &stdout, &stderr, noEnv)
			if code != tt.exit {
				t.Fatalf("exit %d, want %d; stdout %s stderr %s", code, tt.exit, stdout.String(), stderr.String())
			}
			var r podget.Result
			if err := json.Unmarshal(stdout.Bytes(), &r); err != nil {
				t.Fatalf("stdout is not one Result: %v: %q", err, stdout.String())
			}
			if strings.Count(strings.TrimSpace(stdout.String()), "\n") != 0 {
				t.Fatalf("stdout holds more than one line: %q", stdout.String())
			}
			if tt.wantsPod {
				if r.Pod == nil || r.Pod.Name != "web" || r.Pod.Namespace != "app" || r.Pod.UID != "uid-1" || r.Error != "" {
					t.Fatalf("result %+v", r)
				}
				if r.Server != api.URL() {
					t.Fatalf("server %q, want %q", r.Server, api.URL())
				}
				return
			}
			if r.Kind != tt.kind || r.Status != tt.apiCode || !strings.Contains(r.Error, tt.errPart) || r.Pod != nil {
				t.Fatalf("result %+v, want kind %q status %d error containing %q", r, tt.kind, tt.apiCode, tt.errPart)
			}
			if tt.kind == podget.KindAPI && r.Attempts < 1 {
				t.Fatalf("attempts %d", r.Attempts)
			}
		})
	}
}

// TestHelperMainAsCNIPlugin: configured as a CNI plugin by mistake, the helper answers
// with a CNI error instead of reading flags.
func TestHelperMainAsCNIPlugin(t *testing.T) {
	var stdout, stderr bytes.Buffer
	code := Main(nil, &stdout, &stderr, func(k string) string {
		if k == "CNI_COMMAND" {
			return "ADD"
		}
		return ""
	})
	var e struct {
		Code int    `json:"code"`
		Msg  string `json:"msg"`
	}
	if code != 1 || json.Unmarshal(stdout.Bytes(), &e) != nil || e.Code != 4 || !strings.Contains(e.Msg, `"type": "meshcni"`) {
		t.Fatalf("exit %d, stdout %q", code, stdout.String())
	}
}

// TestTokenFileGoneIsAKubeconfigFailure: a tokenFile that disappears after the
// kubeconfig was loaded is reported as a kubeconfig problem (the plugin then says
// "check that meshcni-agent is running"), not as a broken helper.
func TestTokenFileGoneIsAKubeconfigFailure(t *testing.T) {
	api := fakeapi.New(t, "tok")
	api.AddPod(testPod("app", "web", "1"))
	dir := t.TempDir()
	tokenFile := filepath.Join(dir, "token")
	if err := os.WriteFile(tokenFile, []byte("tok"), 0o600); err != nil {
		t.Fatal(err)
	}
	kc := filepath.Join(dir, "kubeconfig")
	doc := fmt.Sprintf("apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: %q, certificate-authority-data: %s}\n"+
		"users:\n- name: u\n  user: {tokenFile: %s}\ncontexts:\n- name: x\n  context: {cluster: c, user: u}\ncurrent-context: x\n",
		api.URL(), base64.StdEncoding.EncodeToString(api.CAPEM()), tokenFile)
	if err := os.WriteFile(kc, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := LoadKubeconfig(kc)
	if err != nil {
		t.Fatal(err)
	}
	c := NewPodClient(cfg)
	if _, err := c.GetPod(context.Background(), "app", "web"); err != nil {
		t.Fatalf("with the token file: %v", err)
	}
	os.Remove(tokenFile)
	pod, err := c.GetPod(context.Background(), "app", "web")
	r := result(c.Server(), kc, pod, err)
	if r.Kind != podget.KindKubeconfig || !strings.Contains(r.Error, "tokenFile") || !strings.Contains(r.Error, kc) {
		t.Fatalf("result %+v", r)
	}
}
