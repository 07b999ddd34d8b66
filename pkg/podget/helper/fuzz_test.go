package helper

import (
	"crypto/tls"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// fuzzFiles are the only files a fuzzed kubeconfig may name (relative to its
// directory); an input naming any other file is skipped, so that the fuzzer never
// reads a device or a file outside its directory.
var fuzzFiles = []string{"", "token", "empty-token", "ca.crt", "missing"}

func namesOnlyFuzzFiles(data []byte) bool {
	var kc kubeconfig
	if yaml.Unmarshal(data, &kc) != nil {
		return true // ParseKubeconfig fails before it reads any file
	}
	var refs []string
	for _, c := range kc.Clusters {
		refs = append(refs, c.Cluster.CertificateAuthority)
	}
	for _, u := range kc.Users {
		refs = append(refs, u.User.TokenFile, u.User.ClientCertificate, u.User.ClientKey)
	}
	for _, r := range refs {
		ok := false
		for _, f := range fuzzFiles {
			ok = ok || r == f
		}
		if !ok {
			return false
		}
	}
	return true
}

// FuzzParseKubeconfig: a kubeconfig is either an error that says which part is
// wrong (the parse, the context, the cluster or the user) or an APIConfig whose
// server is an http(s) URL with a host, whose TLS floor is 1.2, whose token carries
// no surrounding space and whose token file is an absolute path.
func FuzzParseKubeconfig(f *testing.F) {
	dir := f.TempDir()
	for name, content := range map[string]string{"token": "tok-en\n", "empty-token": " \n", "ca.crt": "not a certificate\n"} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o600); err != nil {
			f.Fatal(err)
		}
	}
	for _, s := range []string{
		"apiVersion: v1\nkind: Config\ncurrent-context: meshcni\nclusters:\n- name: local\n  cluster:\n    server: https://10.96.0.1:443\n    certificate-authority-data: bm90IHBlbQ==\nusers:\n- name: meshcni\n  user:\n    token: abc\ncontexts:\n- name: meshcni\n  context:\n    cluster: local\n    user: meshcni\n",
		"contexts:\n- name: c\n  context: {cluster: k, user: u}\nclusters:\n- name: k\n  cluster: {server: 'http://[fd00::1]:6443', insecure-skip-tls-verify: true}\nusers:\n- name: u\n  user: {tokenFile: token}\n",
		"contexts:\n- name: c\n  context: {cluster: k, user: u}\nclusters:\n- name: k\n  cluster: {server: 'https://api', certificate-authority: ca.crt}\nusers:\n- name: u\n  user: {tokenFile: empty-token}\n",
		"contexts:\n- name: c\n  context: {cluster: k, user: u}\nclusters:\n- name: k\n  cluster: {server: 'https://api'}\nusers:\n- name: u\n  user: {exec: {command: sh}}\n",
		"contexts:\n- name: c\n  context: {cluster: k}\nclusters:\n- name: k\n  cluster: {server: 'ftp://x'}\n",
		"contexts:\n- name: c\n  context: {cluster: k, user: u}\nclusters:\n- name: k\n  cluster: {server: 'https://api'}\nusers:\n- name: u\n  user: {client-certificate-data: eA==, client-key: missing}\n",
		"current-context: nope\n", "{}", "- a\n", "clusters: 1\n", "\t", "contexts: [{name: c}, {name: d}]\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if !namesOnlyFuzzFiles(data) {
			return // an input naming files outside the fuzz directory is out of scope, not a skip
		}
		cfg, err := ParseKubeconfig(data, dir)
		if err != nil {
			msg := err.Error()
			for _, part := range []string{"parse: ", "context", "cluster ", "user ", "token"} {
				if strings.Contains(msg, part) {
					return
				}
			}
			t.Fatalf("error names no part of the kubeconfig: %v", err)
		}
		if cfg.Server == nil || cfg.Server.Host == "" || (cfg.Server.Scheme != "https" && cfg.Server.Scheme != "http") {
			t.Fatalf("server %v", cfg.Server)
		}
		if cfg.TLS == nil || cfg.TLS.MinVersion < tls.VersionTLS12 {
			t.Fatalf("TLS config %+v", cfg.TLS)
		}
		if cfg.Token != strings.TrimSpace(cfg.Token) {
			t.Fatalf("token %q has surrounding space", cfg.Token)
		}
		if cfg.TokenFile != "" && !filepath.IsAbs(cfg.TokenFile) {
			t.Fatalf("token file %q is relative", cfg.TokenFile)
		}
	})
}
