package cachedir

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
)

func TestPublish(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "k8s-v1-abc")
	// A failed fill publishes nothing and leaves no temporary directory.
	if err := Publish(dir, func(tmp string) error { return errors.New("boom") }); err == nil {
		t.Fatal("a failed fill: no error")
	}
	if entries, _ := os.ReadDir(filepath.Dir(dir)); len(entries) != 0 || Complete(dir) {
		t.Fatalf("after a failed fill: %v, complete %v", entries, Complete(dir))
	}
	if err := Publish(dir, func(tmp string) error { return os.WriteFile(filepath.Join(tmp, "bin"), []byte("one"), 0o755) }); err != nil {
		t.Fatal(err)
	}
	if !Complete(dir) {
		t.Fatal("not complete after Publish")
	}
	if fi, err := os.Stat(dir); err != nil || fi.Mode().Perm() != 0o755 {
		t.Errorf("published dir: %v, mode %v, want 0755", err, fi.Mode().Perm())
	}
	// A second build of the same key keeps the first.
	if err := Publish(dir, func(tmp string) error { return os.WriteFile(filepath.Join(tmp, "bin"), []byte("two"), 0o755) }); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "bin")); string(b) != "one" {
		t.Errorf("bin = %q, want the first build's", b)
	}
}

func TestHash(t *testing.T) {
	// Length-prefixed: moving a byte between parts changes the hash.
	if Hash([]byte("ab"), []byte("c")) == Hash([]byte("a"), []byte("bc")) {
		t.Error("parts run into each other")
	}
	if got := Hash([]byte("x")); len(got) != 16 || got != Hash([]byte("x")) {
		t.Errorf("Hash = %q, want 16 stable hex digits", got)
	}
}

func TestRoot(t *testing.T) {
	t.Setenv("XDG_CACHE_HOME", "/c")
	if got := Root("testbed"); got != "/c/meshcni/testbed" {
		t.Errorf("Root = %q", got)
	}
}
