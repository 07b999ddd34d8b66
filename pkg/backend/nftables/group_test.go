package nftables

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestGroupResolver(t *testing.T) {
	path := filepath.Join(t.TempDir(), "group")
	data := "# comment\nroot:x:0:\n+nis::::\njava:x:4242:a,b\njava:x:9999:\n\nftp:x:50:\n"
	if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
	g := &groupResolver{path: path}
	for _, tc := range []struct {
		in      string
		want    uint32
		wantErr string
	}{
		{"java", 4242, ""},
		{"ftp", 50, ""},
		{"202", 202, ""},
		{"nope", 0, `group "nope": no such group`},
	} {
		got, err := g.gid(tc.in)
		if tc.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("gid(%q) error = %v, want %q", tc.in, err, tc.wantErr)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("gid(%q) = %d, %v; want %d", tc.in, got, err, tc.want)
		}
	}
	if _, err := parseGroups([]byte("bad:x:notanumber:\n")); err == nil {
		t.Error("a bad GID parsed")
	}
}
