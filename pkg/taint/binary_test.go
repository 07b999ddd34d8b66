package taint

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/internal/env/testbed"
	itestutil "github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/internal/tools/build/ociimage"
)

// TestBinary runs the built meshcni-taint-controller against the real API server, set
// only through MESHCNI_* variables and POD_NAMESPACE (as the chart does): it serves
// /readyz and /metrics, leads, taints and untaints, logs only JSON, and on SIGTERM exits
// 0 having released its Lease.
func TestBinary(t *testing.T) {
	e := newEnv(t, "meshcni-taint-bin", "bin")
	itestutil.RequireBinary(t, "go")
	root, err := itestutil.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(t.TempDir(), Component)
	if err := ociimage.GoBinary(context.Background(), root, "./cmd/meshcni-taint-controller", bin); err != nil {
		t.Fatal(err)
	}

	cmd := exec.Command(bin)
	cmd.Env = []string{
		"POD_NAMESPACE=" + e.ns,
		"MESHCNI_KUBECONFIG=" + testbed.KubeconfigPath(),
		"MESHCNI_NODE_SELECTOR=" + testNodeLabel + "=" + e.label,
		"MESHCNI_GRACE_PERIOD=2s",
		"MESHCNI_LEASE_DURATION=2s", "MESHCNI_RENEW_DEADLINE=1s", "MESHCNI_RETRY_PERIOD=500ms",
		"MESHCNI_HEALTH_ADDR=127.0.0.1:0",
		"MESHCNI_IDENTITY=binary",
	}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	addr := make(chan string, 1)
	var mu sync.Mutex
	var badLines []string
	var scanned sync.WaitGroup
	scanned.Add(1)
	go func() {
		defer scanned.Done()
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			line := sc.Text()
			t.Log(line)
			var rec map[string]any
			if err := json.Unmarshal([]byte(line), &rec); err != nil {
				mu.Lock()
				badLines = append(badLines, line)
				mu.Unlock()
				continue
			}
			if a, ok := rec["addr"].(string); ok && strings.HasPrefix(fmt.Sprint(rec["msg"]), "serving") {
				addr <- a
			}
		}
	}()
	go func() { scanned.Wait(); exited <- cmd.Wait() }()
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			<-exited
		}
	})

	var base string
	select {
	case a := <-addr:
		base = "http://" + a
	case err := <-exited:
		t.Fatalf("exited before serving: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("no health server within 10s")
	}
	e.eventually(5*time.Second, "/readyz 200 and leading", func() bool {
		code, _ := get(t, base+"/readyz")
		_, m := get(t, base+"/metrics")
		return code == http.StatusOK && strings.Contains(m, "meshcni_taint_leader 1\n")
	})
	e.createNode("bin-1")
	e.waitTaint("bin-1", true, time.Second)
	e.createAgent("agent-bin-1", "bin-1", true)
	e.waitTaint("bin-1", false, 5*time.Second)
	if code, body := get(t, base+"/healthz"); code != http.StatusOK {
		t.Errorf("/healthz %d %s", code, body)
	}
	// The node's taint is gone in the API before the controller counts its patch:
	// wait for the counters rather than scrape once.
	wants := []string{`meshcni_taint_changes_total{action="add"} 1`, `meshcni_taint_changes_total{action="remove"} 1`, "meshcni_taint_nodes_tainted 0"}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		_, m := get(t, base+"/metrics")
		var missing []string
		for _, want := range wants {
			if !strings.Contains(m, want+"\n") {
				missing = append(missing, want)
			}
		}
		if len(missing) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("/metrics lacks %q after 5s", missing)
			break
		}
	}

	stopped := time.Now()
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-exited:
		if err != nil {
			t.Fatalf("exit after SIGTERM: %v, want 0", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("still running 10s after SIGTERM")
	}
	t.Logf("exited 0 %s after SIGTERM", time.Since(stopped).Round(time.Millisecond))
	l, err := e.cs.CoordinationV1().Leases(e.ns).Get(e.ctx, "meshcni-taint-controller", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if h := l.Spec.HolderIdentity; h != nil && *h != "" {
		t.Errorf("Lease still held by %q after a graceful stop", *h)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(badLines) > 0 {
		t.Errorf("%d log lines are not JSON, e.g. %q", len(badLines), badLines[0])
	}
}
