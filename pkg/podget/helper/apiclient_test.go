package helper

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	ktypes "k8s.io/apimachinery/pkg/types"

	"github.com/meshcni/meshcni/internal/standin/fakeapi"
)

func testPod(ns, name, uid string) *corev1.Pod {
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, UID: ktypes.UID("uid-" + uid)}}
}

func TestPodClientToken(t *testing.T) {
	api := fakeapi.New(t, "s3cret")
	api.AddPod(testPod("app", "web", "1"))
	cfg, err := LoadKubeconfig(api.Kubeconfig(t, filepath.Join(t.TempDir(), "kubeconfig")))
	if err != nil {
		t.Fatal(err)
	}
	c := NewPodClient(cfg)
	p, err := c.GetPod(context.Background(), "app", "web")
	if err != nil {
		t.Fatal(err)
	}
	if p.Name != "web" || p.UID != "uid-1" {
		t.Fatalf("got %s %s", p.Name, p.UID)
	}
}

func TestPodClientFailures(t *testing.T) {
	api := fakeapi.New(t, "tok")
	cfg, err := LoadKubeconfig(api.Kubeconfig(t, filepath.Join(t.TempDir(), "kubeconfig")))
	if err != nil {
		t.Fatal(err)
	}
	c := NewPodClient(cfg)
	c.Backoff = 10 * time.Millisecond

	// 403 is final: one attempt.
	api.SetStatus(403)
	before := api.Hits()
	_, err = c.GetPod(context.Background(), "app", "web")
	var ae *APIError
	if !errors.As(err, &ae) || ae.Status != 403 || !strings.Contains(err.Error(), "cannot get resource") {
		t.Fatalf("403: %v", err)
	}
	if n := api.Hits() - before; n != 1 {
		t.Fatalf("403 retried: %d requests", n)
	}

	// 404 and 503 are retried until the deadline.
	for _, code := range []int{404, 503} {
		api.SetStatus(code)
		before = api.Hits()
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		_, err = c.GetPod(ctx, "app", "web")
		cancel()
		if !errors.As(err, &ae) || ae.Status != code {
			t.Fatalf("%d: %v", code, err)
		}
		if n := api.Hits() - before; n < 3 {
			t.Fatalf("%d: only %d attempts before the deadline", code, n)
		}
	}

	// Wrong token.
	api.SetStatus(0)
	cfg.Token = "wrong"
	_, err = NewPodClient(cfg).GetPod(context.Background(), "app", "web")
	if !errors.As(err, &ae) || ae.Status != 401 {
		t.Fatalf("401: %v", err)
	}
}

func TestPodClientUnreachable(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	cfg, err := ParseKubeconfig([]byte(fmt.Sprintf(`
clusters: [{name: c, cluster: {server: "https://%s", insecure-skip-tls-verify: true}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
`, addr)), "/")
	if err != nil {
		t.Fatal(err)
	}
	c := NewPodClient(cfg)
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	_, err = c.GetPod(ctx, "app", "web")
	if took := time.Since(start); took > 2*time.Second {
		t.Fatalf("took %s, deadline 500ms", took)
	}
	var ae *APIError
	if !errors.As(err, &ae) || ae.Status != 0 || !strings.Contains(err.Error(), "cannot reach the Kubernetes API at https://"+addr) {
		t.Fatalf("got %v", err)
	}
}

// certs makes a CA, a server certificate for 127.0.0.1 and a client certificate.
func certs(t *testing.T) (caPEM []byte, server tls.Certificate, clientCert, clientKey []byte) {
	t.Helper()
	key := func() *ecdsa.PrivateKey {
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	caKey := key()
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test-ca"}, NotBefore: time.Now().Add(-time.Hour),
		NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, _ := x509.ParseCertificate(caDER)
	issue := func(cn string, usage x509.ExtKeyUsage, ips []net.IP) ([]byte, []byte) {
		k := key()
		tmpl := &x509.Certificate{SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: cn},
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), ExtKeyUsage: []x509.ExtKeyUsage{usage}, IPAddresses: ips,
			KeyUsage: x509.KeyUsageDigitalSignature}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &k.PublicKey, caKey)
		if err != nil {
			t.Fatal(err)
		}
		kd, _ := x509.MarshalECPrivateKey(k)
		return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kd})
	}
	sc, sk := issue("apiserver", x509.ExtKeyUsageServerAuth, []net.IP{net.ParseIP("127.0.0.1")})
	server, err = tls.X509KeyPair(sc, sk)
	if err != nil {
		t.Fatal(err)
	}
	clientCert, clientKey = issue("system:node:test", x509.ExtKeyUsageClientAuth, nil)
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}), server, clientCert, clientKey
}

func TestPodClientClientCertificate(t *testing.T) {
	caPEM, serverCert, cc, ck := certs(t)
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(caPEM)
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if len(r.TLS.PeerCertificates) == 0 || r.TLS.PeerCertificates[0].Subject.CommonName != "system:node:test" {
			fakeapi.WriteStatus(w, 401, "no client certificate")
			return
		}
		_, _ = w.Write([]byte(`{"metadata":{"name":"web","namespace":"app","uid":"u1"}}`))
	}))
	srv.TLS = &tls.Config{Certificates: []tls.Certificate{serverCert}, ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: pool}
	srv.StartTLS()
	defer srv.Close()

	dir := t.TempDir()
	for name, data := range map[string][]byte{"ca.crt": caPEM, "client.crt": cc, "client.key": ck} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	b64 := base64.StdEncoding.EncodeToString
	variants := map[string]string{
		// Relative file paths resolve against the kubeconfig's directory.
		"files": fmt.Sprintf(`
current-context: x
clusters: [{name: c, cluster: {server: %q, certificate-authority: ca.crt}}]
users: [{name: u, user: {client-certificate: %s, client-key: client.key}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
`, srv.URL, filepath.Join(dir, "client.crt")),
		"inline data": fmt.Sprintf(`
current-context: x
clusters: [{name: c, cluster: {server: %q, certificate-authority-data: %s}}]
users: [{name: u, user: {client-certificate-data: %s, client-key-data: %s}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
`, srv.URL, b64(caPEM), b64(cc), b64(ck)),
	}
	for name, kc := range variants {
		t.Run(name, func(t *testing.T) {
			path := filepath.Join(dir, "kc-"+strings.ReplaceAll(name, " ", "-"))
			if err := os.WriteFile(path, []byte(kc), 0o600); err != nil {
				t.Fatal(err)
			}
			cfg, err := LoadKubeconfig(path)
			if err != nil {
				t.Fatal(err)
			}
			p, err := NewPodClient(cfg).GetPod(context.Background(), "app", "web")
			if err != nil {
				t.Fatal(err)
			}
			if p.UID != "u1" {
				t.Fatalf("uid %q", p.UID)
			}
		})
	}
}

func TestParseKubeconfigErrors(t *testing.T) {
	for _, tt := range []struct{ doc, want string }{
		{"clusters: [", "parse"},
		{"contexts: []", "no current-context"},
		{"current-context: other\ncontexts: [{name: x, context: {cluster: c}}]", `context "other" not found`},
		{"current-context: x\ncontexts: [{name: x, context: {cluster: c, user: u}}]", `cluster "c"`},
		{"current-context: x\ncontexts: [{name: x, context: {cluster: c, user: u}}]\nclusters: [{name: c, cluster: {server: 'ftp://x'}}]", "not an http(s) URL"},
		{"current-context: x\ncontexts: [{name: x, context: {cluster: c, user: u}}]\nclusters: [{name: c, cluster: {server: 'https://x', certificate-authority-data: '!!'}}]", "not base64"},
		{"current-context: x\ncontexts: [{name: x, context: {cluster: c, user: u}}]\nclusters: [{name: c, cluster: {server: 'https://x'}}]\nusers: [{name: u, user: {exec: {command: aws}}}]", "exec and auth-provider"},
		{"current-context: x\ncontexts: [{name: x, context: {cluster: c, user: u}}]\nclusters: [{name: c, cluster: {server: 'https://x'}}]\nusers: [{name: u, user: {tokenFile: /nonexistent/token}}]", "tokenFile"},
	} {
		_, err := ParseKubeconfig([]byte(tt.doc), "/")
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%q: error %v, want %q", tt.doc, err, tt.want)
		}
	}
}
