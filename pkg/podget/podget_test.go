package podget_test

import (
	"context"
	"errors"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/internal/standin/fakeapi"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/internal/tools/build/ociimage"
	"github.com/meshcni/meshcni/pkg/podget"
)

var (
	buildOnce sync.Once
	helperBin string
	buildErr  error
)

// helper builds cmd/meshcni-podget once per test binary.
func helper(t *testing.T) string {
	t.Helper()
	testutil.RequireBinary(t, "go")
	buildOnce.Do(func() {
		root, err := testutil.RepoRoot()
		if err != nil {
			buildErr = err
			return
		}
		dir, err := os.MkdirTemp("", "podget-test-")
		if err != nil {
			buildErr = err
			return
		}
		helperBin = filepath.Join(dir, podget.HelperName)
		buildErr = ociimage.GoBinary(context.Background(), root, "./cmd/meshcni-podget", helperBin)
	})
	if buildErr != nil {
		t.Fatalf("build %s: %v", podget.HelperName, buildErr)
	}
	return helperBin
}

func TestMain(m *testing.M) {
	code := m.Run()
	if helperBin != "" {
		os.RemoveAll(filepath.Dir(helperBin))
	}
	os.Exit(code)
}

func withDeadline(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// TestGetter runs the real helper binary against a fake API server: the pod, and
// each failure as its typed error.
func TestGetter(t *testing.T) {
	bin := helper(t)
	api := fakeapi.New(t, "tok")
	api.AddPod(&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "app", Name: "web", UID: "u-1",
		Annotations: map[string]string{"sidecar.istio.io/status": "{}"}}})
	kc := api.Kubeconfig(t, filepath.Join(t.TempDir(), "kubeconfig"))

	t.Run("pod", func(t *testing.T) {
		g := &podget.Getter{Helper: bin, Kubeconfig: kc}
		if !strings.Contains(g.Server(), kc) {
			t.Fatalf("Server() before a GET = %q, want it to name the kubeconfig", g.Server())
		}
		p, err := g.GetPod(withDeadline(t, 10*time.Second), "app", "web")
		if err != nil {
			t.Fatal(err)
		}
		if p.Name != "web" || p.Namespace != "app" || p.UID != "u-1" || p.Annotations["sidecar.istio.io/status"] != "{}" {
			t.Fatalf("pod %+v", p)
		}
		if g.Server() != api.URL() {
			t.Fatalf("Server() = %q, want %q", g.Server(), api.URL())
		}
	})
	t.Run("forbidden", func(t *testing.T) {
		api.SetStatus(403)
		defer api.SetStatus(0)
		_, err := (&podget.Getter{Helper: bin, Kubeconfig: kc}).GetPod(withDeadline(t, 10*time.Second), "app", "web")
		var ae *podget.APIError
		if !errors.As(err, &ae) || ae.Status != 403 || ae.Server != api.URL() || ae.Attempts != 1 || !strings.Contains(ae.Error(), "403 Forbidden") {
			t.Fatalf("err %v (%T)", err, err)
		}
	})
	t.Run("kubeconfig missing", func(t *testing.T) {
		_, err := (&podget.Getter{Helper: bin, Kubeconfig: "/nonexistent/kubeconfig"}).GetPod(withDeadline(t, 10*time.Second), "app", "web")
		var ke *podget.KubeconfigError
		if !errors.As(err, &ke) || !strings.Contains(err.Error(), "/nonexistent/kubeconfig") {
			t.Fatalf("err %v (%T)", err, err)
		}
	})
	t.Run("helper missing", func(t *testing.T) {
		missing := filepath.Join(t.TempDir(), podget.HelperName)
		_, err := (&podget.Getter{Helper: missing, Kubeconfig: kc}).GetPod(withDeadline(t, 10*time.Second), "app", "web")
		var he *podget.HelperError
		if !errors.As(err, &he) || !errors.Is(err, fs.ErrNotExist) || !strings.Contains(err.Error(), missing) {
			t.Fatalf("err %v (%T)", err, err)
		}
	})
	t.Run("helper answers nothing", func(t *testing.T) {
		for _, prog := range []string{"/bin/false", "/bin/true"} {
			_, err := (&podget.Getter{Helper: prog, Kubeconfig: kc}).GetPod(withDeadline(t, 10*time.Second), "app", "web")
			var he *podget.HelperError
			if !errors.As(err, &he) || !strings.Contains(err.Error(), prog) {
				t.Fatalf("%s: err %v (%T)", prog, err, err)
			}
		}
	})
	t.Run("no deadline", func(t *testing.T) {
		_, err := (&podget.Getter{Helper: bin, Kubeconfig: kc}).GetPod(context.Background(), "app", "web")
		var he *podget.HelperError
		if !errors.As(err, &he) {
			t.Fatalf("err %v (%T)", err, err)
		}
	})
}

// fakeHelper builds a Go program that stands in for a misbehaving helper (no shell).
func fakeHelper(t *testing.T, src string) string {
	t.Helper()
	gobin := testutil.RequireBinary(t, "go")
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "main.go"), []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "go.mod"), []byte("module fake\ngo 1.22\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "fake")
	cmd := exec.Command(gobin, "build", "-o", bin, ".")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOFLAGS=-mod=mod")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build fake helper: %v\n%s", err, out)
	}
	return bin
}

// TestGetterMisbehavingHelper: a helper that hangs is killed at the deadline plus
// the grace and named; one that floods its output is cut off; one that answers with
// something that is not a pod (kind decode) is an API answer, not a helper fault.
func TestGetterMisbehavingHelper(t *testing.T) {
	hang := fakeHelper(t, `package main
import "time"
func main() { time.Sleep(time.Hour) }
`)
	t0 := time.Now()
	_, err := (&podget.Getter{Helper: hang, Kubeconfig: "/k", Grace: 200 * time.Millisecond}).GetPod(withDeadline(t, 300*time.Millisecond), "app", "web")
	var he *podget.HelperError
	if !errors.As(err, &he) || !strings.Contains(err.Error(), "killed") || time.Since(t0) > 3*time.Second {
		t.Fatalf("hanging helper: %v (%T) after %v", err, err, time.Since(t0))
	}

	flood := fakeHelper(t, `package main
import ("os"; "bytes")
func main() { b := bytes.Repeat([]byte("x"), 1<<20); for i := 0; i < 20; i++ { os.Stdout.Write(b) } }
`)
	_, err = (&podget.Getter{Helper: flood, Kubeconfig: "/k"}).GetPod(withDeadline(t, 10*time.Second), "app", "web")
	if !errors.As(err, &he) || !strings.Contains(err.Error(), "more than") {
		t.Fatalf("flooding helper: %v (%T)", err, err)
	}

	notPod := fakeHelper(t, `package main
import "os"
func main() { os.Stdout.WriteString(`+"`"+`{"server":"https://api:6443","kind":"decode","error":"decode pod: unexpected"}`+"`"+`); os.Exit(1) }
`)
	_, err = (&podget.Getter{Helper: notPod, Kubeconfig: "/k"}).GetPod(withDeadline(t, 10*time.Second), "app", "web")
	var ae *podget.APIError
	if !errors.As(err, &ae) || ae.Status != 200 || ae.Server != "https://api:6443" {
		t.Fatalf("not-a-pod answer: %v (%T)", err, err)
	}

	// Less than a millisecond left: an API deadline error, the helper not run.
	ctx, cancel := context.WithDeadline(context.Background(), time.Now().Add(500*time.Microsecond))
	defer cancel()
	_, err = (&podget.Getter{Helper: hang, Kubeconfig: "/k"}).GetPod(ctx, "app", "web")
	if !errors.As(err, &ae) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("expired deadline: %v (%T)", err, err)
	}
}

// TestGetterDeadline: an API server that accepts and never answers costs the plugin
// its deadline, not more: the helper stops at the deadline it was given.
func TestGetterDeadline(t *testing.T) {
	bin := helper(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			defer c.Close() // held open, never answered
		}
	}()
	kc := filepath.Join(t.TempDir(), "kubeconfig")
	doc := "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: \"https://" + l.Addr().String() + "\", insecure-skip-tls-verify: true}\n" +
		"users:\n- name: u\n  user: {token: t}\ncontexts:\n- name: x\n  context: {cluster: c, user: u}\ncurrent-context: x\n"
	if err := os.WriteFile(kc, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	_, err = (&podget.Getter{Helper: bin, Kubeconfig: kc}).GetPod(withDeadline(t, 500*time.Millisecond), "app", "web")
	took := time.Since(t0)
	var ae *podget.APIError
	if !errors.As(err, &ae) || ae.Status != 0 {
		t.Fatalf("err %v (%T)", err, err)
	}
	if took > 5*time.Second {
		t.Fatalf("gave up after %v, deadline was 500ms", took)
	}
}
