package install

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"k8s.io/client-go/tools/clientcmd"
)

func inode(t *testing.T, p string) uint64 {
	t.Helper()
	fi, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Sys().(*syscall.Stat_t).Ino
}

func TestBinaryInstall(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "src")
	dst := filepath.Join(dir, "bin", "meshcni")
	if err := os.Mkdir(filepath.Dir(dst), 0o755); err != nil {
		t.Fatal(err)
	}
	write := func(p, s string, mode os.FileMode) {
		if err := os.WriteFile(p, []byte(s), mode); err != nil {
			t.Fatal(err)
		}
	}
	write(src, "v1", 0o755)
	b := &Binary{Src: src, Dst: dst}

	if err := b.Check(); err == nil {
		t.Fatal("Check before Install: nil error")
	}
	if changed, err := b.Install(); err != nil || !changed {
		t.Fatalf("first Install = %v, %v; want a copy", changed, err)
	}
	if err := b.Check(); err != nil {
		t.Fatalf("Check: %v", err)
	}
	ino := inode(t, dst)
	if changed, err := b.Install(); err != nil || changed {
		t.Fatalf("Install of unchanged content = %v, %v; want no copy", changed, err)
	}
	if inode(t, dst) != ino {
		t.Error("unchanged binary was rewritten")
	}

	// A new source version (same size, so the hash decides).
	write(src+".new", "v2", 0o755)
	if err := os.Rename(src+".new", src); err != nil {
		t.Fatal(err)
	}
	if err := b.Check(); err == nil {
		t.Error("Check with a new source: nil error")
	}
	if changed, err := b.Install(); err != nil || !changed {
		t.Fatalf("Install of a new version = %v, %v", changed, err)
	}
	if got, _ := os.ReadFile(dst); string(got) != "v2" {
		t.Errorf("installed %q, want v2", got)
	}
	if fi, _ := os.Stat(dst); fi.Mode().Perm() != 0o755 {
		t.Errorf("mode %v, want 0755", fi.Mode().Perm())
	}

	// Someone truncated it in place: detected and repaired.
	write(dst, "", 0o755)
	if changed, err := b.Install(); err != nil || !changed {
		t.Fatalf("Install after a truncation = %v, %v", changed, err)
	}

	if err := b.Remove(); err != nil {
		t.Fatal(err)
	}
	if err := b.Remove(); err != nil {
		t.Fatalf("second Remove: %v", err)
	}
	b2 := &Binary{Src: filepath.Join(dir, "missing"), Dst: dst}
	if _, err := b2.Install(); err == nil || !strings.Contains(err.Error(), "plugin binary source") {
		t.Errorf("Install from a missing source = %v", err)
	}
	if _, err := os.Stat(dst); err == nil {
		t.Error("a failed Install left a file")
	}
}

// TestBinaryCompanions: the companion (the API helper) is installed before the plugin,
// checked with it, repaired alone when it alone is damaged, removed after it; a
// missing companion source installs nothing.
func TestBinaryCompanions(t *testing.T) {
	dir := t.TempDir()
	srcDir, binDir := filepath.Join(dir, "image"), filepath.Join(dir, "bin")
	for _, d := range []string{srcDir, binDir} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	write := func(p, s string) {
		if err := os.WriteFile(p, []byte(s), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	write(filepath.Join(srcDir, "meshcni"), "plugin")
	b := &Binary{Src: filepath.Join(srcDir, "meshcni"), Dst: filepath.Join(binDir, "meshcni"), Companions: []string{"meshcni-podget"}}
	helperDst := filepath.Join(binDir, "meshcni-podget")

	// Companion source missing: an error naming it, and nothing installed.
	if _, err := b.Install(); err == nil || !strings.Contains(err.Error(), "plugin companion meshcni-podget source") {
		t.Fatalf("Install without the companion's source = %v", err)
	}
	if entries, _ := os.ReadDir(binDir); len(entries) != 0 {
		t.Fatalf("a failed Install left %v", entries)
	}

	write(filepath.Join(srcDir, "meshcni-podget"), "helper")
	if changed, err := b.Install(); err != nil || !changed {
		t.Fatalf("Install = %v, %v", changed, err)
	}
	for p, want := range map[string]string{b.Dst: "plugin", helperDst: "helper"} {
		if got, _ := os.ReadFile(p); string(got) != want {
			t.Fatalf("%s holds %q, want %q", p, got, want)
		}
	}
	if err := b.Check(); err != nil {
		t.Fatal(err)
	}
	plugIno := inode(t, b.Dst)

	// The helper alone damaged: Check says so, Install rewrites only it.
	write(helperDst, "tampered")
	if err := b.Check(); err == nil || !strings.Contains(err.Error(), helperDst) {
		t.Fatalf("Check with a tampered companion = %v", err)
	}
	if changed, err := b.Install(); err != nil || !changed {
		t.Fatalf("repair Install = %v, %v", changed, err)
	}
	if got, _ := os.ReadFile(helperDst); string(got) != "helper" || inode(t, b.Dst) != plugIno {
		t.Fatalf("companion %q after repair; plugin rewritten: %v", got, inode(t, b.Dst) != plugIno)
	}
	os.Remove(helperDst)
	if err := b.Check(); err == nil {
		t.Fatal("Check with the companion removed: nil error")
	}
	if _, err := b.Install(); err != nil {
		t.Fatal(err)
	}

	if err := b.Remove(); err != nil {
		t.Fatal(err)
	}
	if entries, _ := os.ReadDir(binDir); len(entries) != 0 {
		t.Fatalf("Remove left %v", entries)
	}
}

// TestCA returns a PEM self-signed certificate.
func testCA(t *testing.T) []byte {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test-ca"},
		NotBefore: time.Now(), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}

// projected lays out dir like kubelet's atomic writer: ..<ts>/files, ..data → ..<ts>,
// file → ..data/file. Calling it again swaps ..data to a new timestamped directory.
func projected(t *testing.T, dir string, files map[string][]byte) {
	t.Helper()
	ts := filepath.Join(dir, "..ts-"+strings.ReplaceAll(time.Now().Format("150405.000000000"), ".", "_"))
	if err := os.MkdirAll(ts, 0o755); err != nil {
		t.Fatal(err)
	}
	for n, c := range files {
		if err := os.WriteFile(filepath.Join(ts, n), c, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	tmp := filepath.Join(dir, "..data_tmp")
	if err := os.Symlink(filepath.Base(ts), tmp); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, "..data")); err != nil {
		t.Fatal(err)
	}
	for n := range files {
		link := filepath.Join(dir, n)
		if _, err := os.Lstat(link); err != nil {
			if err := os.Symlink(filepath.Join("..data", n), link); err != nil {
				t.Fatal(err)
			}
		}
	}
}

func TestInClusterFromEnv(t *testing.T) {
	for _, tc := range []struct {
		host, port string
		wantServer string
		wantErr    string
	}{
		{"10.96.0.1", "443", "https://10.96.0.1:443", ""},
		{"fd00::1", "6443", "https://[fd00::1]:6443", ""},
		{"kubernetes.default.svc", "443", "https://kubernetes.default.svc:443", ""},
		{"", "443", "", "not running in a pod"},
		{"10.96.0.1", "https", "", "not a port number"},
		{"10.96.0.1", "70000", "", "not a port number"},
		{"bad host!", "443", "", "neither an IP address nor a DNS name"},
	} {
		t.Run(tc.host+":"+tc.port, func(t *testing.T) {
			env := map[string]string{"KUBERNETES_SERVICE_HOST": tc.host, "KUBERNETES_SERVICE_PORT": tc.port}
			s, err := InClusterFromEnv(func(k string) string { return env[k] }, "t", "c")
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if s.Server() != tc.wantServer {
				t.Errorf("Server() = %q, want %q", s.Server(), tc.wantServer)
			}
		})
	}
}

func TestInClusterKubeconfigRotation(t *testing.T) {
	sa := t.TempDir()
	ca := testCA(t)
	projected(t, sa, map[string][]byte{"token": []byte("token-1\n"), "ca.crt": ca})
	src := &InCluster{TokenFile: filepath.Join(sa, "token"), CAFile: filepath.Join(sa, "ca.crt"), Host: "fd00::1", Port: 443}
	k := &Kubeconfig{Source: src, Path: filepath.Join(t.TempDir(), "run", "meshcni-kubeconfig")}

	if changed, err := k.Install(); err != nil || !changed {
		t.Fatalf("Install = %v, %v", changed, err)
	}
	if err := k.Check(); err != nil {
		t.Fatalf("Check: %v", err)
	}
	fi, _ := os.Stat(k.Path)
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("mode %v, want 0600", fi.Mode().Perm())
	}
	cfg, err := clientcmd.LoadFromFile(k.Path)
	if err != nil {
		t.Fatal(err)
	}
	cl := cfg.Clusters[cfg.Contexts[cfg.CurrentContext].Cluster]
	if cl.Server != "https://[fd00::1]:443" || string(cl.CertificateAuthorityData) != string(ca) {
		t.Errorf("cluster = %+v", cl)
	}
	if tok := cfg.AuthInfos[cfg.Contexts[cfg.CurrentContext].AuthInfo].Token; tok != "token-1" {
		t.Errorf("token = %q", tok)
	}
	if changed, _ := k.Install(); changed {
		t.Error("Install with the same token rewrote the file")
	}

	projected(t, sa, map[string][]byte{"token": []byte("token-2"), "ca.crt": ca})
	if err := k.Check(); err == nil {
		t.Error("Check after rotation: nil error, want stale")
	}
	if changed, err := k.Install(); err != nil || !changed {
		t.Fatalf("Install after rotation = %v, %v", changed, err)
	}
	cfg, _ = clientcmd.LoadFromFile(k.Path)
	if tok := cfg.AuthInfos["meshcni"].Token; tok != "token-2" {
		t.Errorf("token after rotation = %q", tok)
	}
}

func TestKubeconfigBadInput(t *testing.T) {
	dir := t.TempDir()
	ca := testCA(t)
	w := func(n string, c []byte) string {
		p := filepath.Join(dir, n)
		if err := os.WriteFile(p, c, 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	good, empty, badCA, goodCA := w("token", []byte("tok")), w("empty", nil), w("bad.crt", []byte("not pem")), w("ca.crt", ca)
	for _, tc := range []struct {
		name    string
		src     KubeconfigSource
		wantErr string
	}{
		{"missing token", &InCluster{TokenFile: filepath.Join(dir, "nope"), CAFile: goodCA, Host: "h", Port: 1}, "service-account token"},
		{"empty token", &InCluster{TokenFile: empty, CAFile: goodCA, Host: "h", Port: 1}, "empty or malformed"},
		{"bad CA", &InCluster{TokenFile: good, CAFile: badCA, Host: "h", Port: 1}, "no PEM certificate"},
		{"missing source", &FromFile{Path: filepath.Join(dir, "nope")}, "kubeconfig source"},
		{"garbage source", &FromFile{Path: w("garbage", []byte("{{{"))}, "kubeconfig source"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out := filepath.Join(dir, "out-"+strings.ReplaceAll(tc.name, " ", "-"))
			if err := os.WriteFile(out, []byte("previous"), 0o600); err != nil {
				t.Fatal(err)
			}
			k := &Kubeconfig{Source: tc.src, Path: out}
			if _, err := k.Install(); err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("Install error = %v, want %q", err, tc.wantErr)
			}
			if got, _ := os.ReadFile(out); string(got) != "previous" {
				t.Errorf("kubeconfig overwritten with %q", got)
			}
			if err := k.Check(); err == nil {
				t.Error("Check: nil error")
			}
		})
	}
}

func TestFromFileEmbeds(t *testing.T) {
	dir := t.TempDir()
	ca := filepath.Join(dir, "ca.crt")
	if err := os.WriteFile(ca, testCA(t), 0o644); err != nil {
		t.Fatal(err)
	}
	src := filepath.Join(dir, "admin.conf")
	conf := `apiVersion: v1
kind: Config
clusters:
- name: c
  cluster:
    server: https://127.0.0.1:6443
    certificate-authority: ca.crt
users:
- name: u
  user:
    token: abc
contexts:
- name: ctx
  context: {cluster: c, user: u}
current-context: ctx
`
	if err := os.WriteFile(src, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	k := &Kubeconfig{Source: &FromFile{Path: src}, Path: filepath.Join(dir, "out")}
	if _, err := k.Install(); err != nil {
		t.Fatal(err)
	}
	cfg, err := clientcmd.LoadFromFile(k.Path)
	if err != nil {
		t.Fatal(err)
	}
	if c := cfg.Clusters["c"]; len(c.CertificateAuthorityData) == 0 || c.CertificateAuthority != "" {
		t.Errorf("CA not embedded: %+v", c)
	}
}
