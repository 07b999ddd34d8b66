package main

import (
	"bufio"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
)

// TestVersionFromLdflags: the version set with -ldflags "-X main.version=..." (as the
// image build sets it) is what the running agent serves on GET /version.
func TestVersionFromLdflags(t *testing.T) {
	gobin := testutil.RequireBinary(t, "go")
	dir := t.TempDir()
	bin := filepath.Join(dir, "meshcni-agent")
	const version = "9.9.9-ldflags"
	build := exec.Command(gobin, "build", "-trimpath", "-ldflags=-X main.version="+version, "-o", bin, ".")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	for _, d := range []string{"bin", "net.d", "src"} {
		if err := os.Mkdir(filepath.Join(dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	plugin, kc := filepath.Join(dir, "src", "meshcni"), filepath.Join(dir, "kubeconfig")
	for p, data := range map[string]string{plugin: "#!/bin/false\n", filepath.Join(dir, "src", "meshcni-podget"): "#!/bin/false\n", kc: "apiVersion: v1\nkind: Config\n"} {
		if err := os.WriteFile(p, []byte(data), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	run, err := os.MkdirTemp("", "mcniv") // short: the agent socket's path must fit a sockaddr_un
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(run)
	cmd := exec.Command(bin, "--cni-bin-dir", filepath.Join(dir, "bin"), "--cni-conf-dir", filepath.Join(dir, "net.d"),
		"--run-dir", run, "--plugin-binary", plugin, "--kubeconfig-source", kc, "--health-addr", "127.0.0.1:0",
		"--keep-on-exit=never", "--token-file", filepath.Join(dir, "token"), "--ca-file", filepath.Join(dir, "ca"))
	cmd.Env = []string{"PATH=" + os.Getenv("PATH")}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		_ = cmd.Wait()
	}()
	addr := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			var rec struct{ Msg, Addr string }
			if json.Unmarshal(sc.Bytes(), &rec) == nil && strings.Contains(rec.Msg, "/version") && rec.Addr != "" {
				addr <- rec.Addr
				break
			}
		}
		_, _ = io.Copy(io.Discard, stderr)
	}()
	var a string
	select {
	case a = <-addr:
	case <-time.After(30 * time.Second): // a hang guard, not a speed bound
		t.Fatal("the agent did not log its health address")
	}
	resp, err := (&http.Client{Timeout: 5 * time.Second}).Get("http://" + a + "/version")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var got struct {
		Version string `json:"version"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&got); err != nil || got.Version != version {
		t.Errorf("/version version = %q (%v), want %q", got.Version, err, version)
	}
}
