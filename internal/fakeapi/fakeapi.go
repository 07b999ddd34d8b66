package plugin

import (
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	corev1 "k8s.io/api/core/v1"
)

// fakeAPI is an httptest TLS server that serves pod GETs, for unit tests only (the
// real-API tests use pkg/testbed).
type fakeAPI struct {
	srv    *httptest.Server
	token  string
	mu     sync.Mutex
	pods   map[string]*corev1.Pod // "ns/name"
	status int                    // forced status (0: serve pods)
	hits   atomic.Int64
}

func newFakeAPI(t *testing.T, token string) *fakeAPI {
	f := &fakeAPI{token: token, pods: map[string]*corev1.Pod{}}
	f.srv = httptest.NewTLSServer(http.HandlerFunc(f.serve))
	t.Cleanup(f.srv.Close)
	return f
}

func (f *fakeAPI) addPod(p *corev1.Pod) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.pods[p.Namespace+"/"+p.Name] = p
}

func (f *fakeAPI) setStatus(code int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.status = code
}

func writeStatus(w http.ResponseWriter, code int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(map[string]any{"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": msg, "code": code})
}

func (f *fakeAPI) serve(w http.ResponseWriter, r *http.Request) {
	f.hits.Add(1)
	if f.token != "" && r.Header.Get("Authorization") != "Bearer "+f.token {
		writeStatus(w, 401, "Unauthorized")
		return
	}
	f.mu.Lock()
	status := f.status
	f.mu.Unlock()
	parts := strings.Split(strings.Trim(r.URL.Path, "/"), "/")
	if len(parts) != 6 || parts[0] != "api" || parts[1] != "v1" || parts[2] != "namespaces" || parts[4] != "pods" {
		writeStatus(w, 404, "no such path "+r.URL.Path)
		return
	}
	ns, name := parts[3], parts[5]
	if status == 403 {
		writeStatus(w, 403, fmt.Sprintf(`pods %q is forbidden: User "system:serviceaccount:kube-system:nobody" cannot get resource "pods" in API group "" in the namespace %q`, name, ns))
		return
	}
	if status != 0 {
		writeStatus(w, status, "forced failure")
		return
	}
	f.mu.Lock()
	p := f.pods[ns+"/"+name]
	f.mu.Unlock()
	if p == nil {
		writeStatus(w, 404, fmt.Sprintf("pods %q not found", name))
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(p)
}

// kubeconfig writes a token kubeconfig for the server with inline CA data.
func (f *fakeAPI) kubeconfig(t *testing.T, dir string) string {
	t.Helper()
	ca := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: f.srv.Certificate().Raw})
	path := filepath.Join(dir, KubeconfigName)
	data := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: c
  cluster:
    server: %s
    certificate-authority-data: %s
users:
- name: u
  user:
    token: %s
contexts:
- name: x
  context: {cluster: c, user: u}
current-context: x
`, f.srv.URL, base64.StdEncoding.EncodeToString(ca), f.token)
	if err := os.WriteFile(path, []byte(data), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}
