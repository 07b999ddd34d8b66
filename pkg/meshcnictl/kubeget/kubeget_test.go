package kubeget

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func writeKubeconfig(t *testing.T, dir, name, namespace string) string {
	t.Helper()
	ns := ""
	if namespace != "" {
		ns = ", namespace: " + namespace
	}
	cfg := "apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: \"https://127.0.0.1:1\"}}]\n" +
		"users: [{name: u, user: {token: t}}]\ncontexts: [{name: x, context: {cluster: c, user: u" + ns + "}}]\ncurrent-context: x\n"
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestNamespace(t *testing.T) {
	dir := t.TempDir()
	shop := writeKubeconfig(t, dir, "shop", "shop")
	none := writeKubeconfig(t, dir, "none", "")
	for _, tc := range []struct {
		kubeconfig, want, wantErr string
	}{
		{shop, "shop", ""},
		{none, "default", ""},
		{shop + string(filepath.ListSeparator) + none, "shop", ""}, // merged as kubectl does: the first file's context wins
		{filepath.Join(dir, "missing"), "", "kubeconfig " + filepath.Join(dir, "missing")},
	} {
		got, err := Namespace(tc.kubeconfig)
		if tc.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("Namespace(%q) = %q, %v; want error with %q", tc.kubeconfig, got, err, tc.wantErr)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("Namespace(%q) = %q, %v; want %q", tc.kubeconfig, got, err, tc.want)
		}
	}
}
