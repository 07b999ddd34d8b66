// Package fakeapi is an httptest TLS server that answers pod GETs the way the
// Kubernetes API does (JSON pods, Status errors, bearer tokens), for unit tests of the
// plugin's API path (pkg/podget/helper, pkg/plugin). Tests of Kubernetes behaviour use the
// real API server of internal/env/testbed instead.
package fakeapi

import (
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	corev1 "k8s.io/api/core/v1"
)

// Server serves pod GETs.
type Server struct {
	srv    *httptest.Server
	token  string
	mu     sync.Mutex
	pods   map[string]*corev1.Pod // "ns/name"
	status int                    // forced status (0: serve pods)
	hits   atomic.Int64
}

// URL is the server's https URL.
func (f *Server) URL() string { return f.srv.URL }

// Hits counts the requests served.
func (f *Server) Hits() int64 { return f.hits.Load() }

// New starts a server that wants token as bearer ("" accepts any request); it stops
// with the test.
func New(t testing.TB, token string) *Server {
	f := &Server{token: token, pods: map[string]*corev1.Pod{}}
	f.srv = httptest.NewTLSServer(http.HandlerFunc(f.serve))
	t.Cleanup(f.srv.Close)
	return f
}

// AddPod serves p at its namespace and name.
func (f *Server) AddPod(p *corev1.Pod) {
	f.SetPod(p.Namespace+"/"+p.Name, p)
}

// SetPod serves p under key "namespace/name", which may differ from p's own.
func (f *Server) SetPod(key string, p *corev1.Pod) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.pods[key] = p
}

// SetStatus makes every GET fail with code (0: serve pods again).
func (f *Server) SetStatus(code int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.status = code
}

// WriteStatus writes a Kubernetes Status error.
func WriteStatus(w http.ResponseWriter, code int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(map[string]any{"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": msg, "code": code})
}

func (f *Server) serve(w http.ResponseWriter, r *http.Request) {
	f.hits.Add(1)
	if f.token != "" && r.Header.Get("Authorization") != "Bearer "+f.token {
		WriteStatus(w, 401, "Unauthorized")
		return
	}
	f.mu.Lock()
	status := f.status
	f.mu.Unlock()
	parts := strings.Split(strings.Trim(r.URL.Path, "/"), "/")
	if len(parts) != 6 || parts[0] != "api" || parts[1] != "v1" || parts[2] != "namespaces" || parts[4] != "pods" {
		WriteStatus(w, 404, "no such path "+r.URL.Path)
		return
	}
	ns, name := parts[3], parts[5]
	if status == 403 {
		WriteStatus(w, 403, fmt.Sprintf(`pods %q is forbidden: User "system:serviceaccount:kube-system:nobody" cannot get resource "pods" in API group "" in the namespace %q`, name, ns))
		return
	}
	if status != 0 {
		WriteStatus(w, status, "forced failure")
		return
	}
	f.mu.Lock()
	p := f.pods[ns+"/"+name]
	f.mu.Unlock()
	if p == nil {
		WriteStatus(w, 404, fmt.Sprintf("pods %q not found", name))
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(p)
}

// CAPEM is the server certificate, PEM-encoded.
func (f *Server) CAPEM() []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: f.srv.Certificate().Raw})
}

// Kubeconfig writes a token kubeconfig for the server, with inline CA data, at path
// (mode 0600) and returns path.
func (f *Server) Kubeconfig(t testing.TB, path string) string {
	t.Helper()
	ca := f.CAPEM()
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
