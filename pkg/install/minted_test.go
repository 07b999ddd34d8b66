package install

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"k8s.io/client-go/tools/clientcmd"
)

// TestMinted: the kubeconfig of a minted token is ErrNoToken before the first token,
// holds the token until it expires, and is an error naming the last renewal failure
// after; a new token makes it valid again.
func TestMinted(t *testing.T) {
	dir := t.TempDir()
	caFile := filepath.Join(dir, "ca.crt")
	if err := os.WriteFile(caFile, testCA(t), 0o644); err != nil {
		t.Fatal(err)
	}
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	s := &Minted{API: &InCluster{TokenFile: "/unused", CAFile: caFile, Host: "10.0.0.1", Port: 443}, Now: func() time.Time { return now }}
	if _, err := s.Kubeconfig(); !errors.Is(err, ErrNoToken) {
		t.Fatalf("before a token: %v, want ErrNoToken", err)
	}
	if got := s.WatchDirs(); len(got) != 1 || got[0] != dir {
		t.Errorf("WatchDirs %v, want [%s]", got, dir)
	}
	for _, bad := range []string{"", "  ", "a b", "a\nb"} {
		if err := s.SetToken(bad, now.Add(time.Hour)); err == nil {
			t.Errorf("SetToken(%q) accepted", bad)
		}
	}
	exp := now.Add(time.Hour)
	if err := s.SetToken("tok-1\n", exp); err != nil {
		t.Fatal(err)
	}
	b, err := s.Kubeconfig()
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := clientcmd.Load(b)
	if err != nil {
		t.Fatal(err)
	}
	if u := cfg.AuthInfos[cfg.Contexts[cfg.CurrentContext].AuthInfo]; u == nil || u.Token != "tok-1" {
		t.Errorf("kubeconfig user %+v, want token tok-1", u)
	}
	if c := cfg.Clusters[cfg.Contexts[cfg.CurrentContext].Cluster]; c == nil || c.Server != "https://10.0.0.1:443" || len(c.CertificateAuthorityData) == 0 {
		t.Errorf("kubeconfig cluster %+v", c)
	}
	if !s.Expires().Equal(exp) {
		t.Errorf("Expires %v, want %v", s.Expires(), exp)
	}
	s.SetError(errors.New("forbidden: no token for you"))
	if _, err := s.Kubeconfig(); err != nil {
		t.Errorf("a failed renewal before expiry: %v, want the current token kept", err)
	}
	now = exp
	_, err = s.Kubeconfig()
	if err == nil || !strings.Contains(err.Error(), "expired at 2026-01-02T04:04:05Z") || !strings.Contains(err.Error(), "forbidden: no token for you") {
		t.Errorf("expired: %v", err)
	}
	if err := s.SetToken("tok-2", now.Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	if b, err := s.Kubeconfig(); err != nil || !strings.Contains(string(b), "tok-2") {
		t.Errorf("after a new token: %v\n%s", err, b)
	}
}

// TestMintedKubeconfigUnready: the agent's kubeconfig check (its readiness) fails once
// the token has expired, though the file on disk is unchanged.
func TestMintedKubeconfigUnready(t *testing.T) {
	dir := t.TempDir()
	caFile := filepath.Join(dir, "ca.crt")
	if err := os.WriteFile(caFile, testCA(t), 0o644); err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	s := &Minted{API: &InCluster{CAFile: caFile, Host: "127.0.0.1", Port: 6443}, Now: func() time.Time { return now }}
	k := &Kubeconfig{Source: s, Path: filepath.Join(dir, "run", "meshcni-kubeconfig")}
	if err := s.SetToken("tok", now.Add(10*time.Minute)); err != nil {
		t.Fatal(err)
	}
	if _, err := k.Install(); err != nil {
		t.Fatal(err)
	}
	if err := k.Check(); err != nil {
		t.Fatalf("fresh token: %v", err)
	}
	now = now.Add(10 * time.Minute)
	if err := k.Check(); err == nil || !strings.Contains(err.Error(), "expired") {
		t.Errorf("expired token: Check = %v, want an error", err)
	}
}
