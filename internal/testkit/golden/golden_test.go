package golden

import (
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"sort"
	"strings"
	"sync"
	"testing"
)

// recorder is a testing.TB that records failures instead of failing the real test.
type recorder struct {
	testing.TB
	mu       sync.Mutex
	errs     []string
	cleanups []func()
}

func (r *recorder) Helper() {}
func (r *recorder) Errorf(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.errs = append(r.errs, fmt.Sprintf(format, args...))
}
func (r *recorder) Fatalf(format string, args ...any) {
	r.Errorf(format, args...)
	runtime.Goexit()
}
func (r *recorder) Cleanup(f func()) { r.cleanups = append(r.cleanups, f) }
func (r *recorder) Failed() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.errs) > 0
}
func (r *recorder) Skipped() bool { return false }

// run runs fn as a test body on a recorder, then its cleanups, and returns the failures.
func run(fn func(tb testing.TB)) []string {
	r := &recorder{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		fn(r)
	}()
	<-done
	for i := len(r.cleanups) - 1; i >= 0; i-- {
		r.cleanups[i]()
	}
	return r.errs
}

// dirWith makes a golden directory holding files (name → content).
func dirWith(t *testing.T, files map[string]string) string {
	t.Helper()
	dir := t.TempDir()
	for name, content := range files {
		p := filepath.Join(dir, filepath.FromSlash(name))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func readAll(t *testing.T, dir string) map[string]string {
	t.Helper()
	out := map[string]string{}
	err := filepath.WalkDir(dir, func(p string, e os.DirEntry, err error) error {
		if err != nil || e.IsDir() {
			return err
		}
		b, err := os.ReadFile(p)
		rel, _ := filepath.Rel(dir, p)
		out[filepath.ToSlash(rel)] = string(b)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func wantOneError(t *testing.T, errs []string, parts ...string) {
	t.Helper()
	if len(errs) != 1 {
		t.Fatalf("got %d failures %q, want 1", len(errs), errs)
	}
	for _, p := range parts {
		if !strings.Contains(errs[0], p) {
			t.Errorf("failure %q does not say %q", errs[0], p)
		}
	}
}

func TestMatchingFilesPass(t *testing.T) {
	dir := dirWith(t, map[string]string{"a.txt": "alpha\n", "sub/b.txt": "beta\n"})
	errs := run(func(tb testing.TB) {
		d := Open(tb, dir)
		d.CheckString(tb, "a.txt", "alpha\n")
		d.CheckString(tb, "sub/b.txt", "beta\n")
	})
	if len(errs) != 0 {
		t.Fatalf("failures: %q", errs)
	}
}

func TestDifferentContentFails(t *testing.T) {
	dir := dirWith(t, map[string]string{"a.txt": "one\ntwo\nthree\n"})
	errs := run(func(tb testing.TB) {
		Open(tb, dir).CheckString(tb, "a.txt", "one\nTWO\nthree\n")
	})
	wantOneError(t, errs, "a.txt", "line 2", "got:  TWO", "want: two", "-update")
}

func TestMissingFileFails(t *testing.T) {
	dir := dirWith(t, map[string]string{"a.txt": "alpha\n"})
	errs := run(func(tb testing.TB) {
		d := Open(tb, dir)
		d.CheckString(tb, "a.txt", "alpha\n")
		d.CheckString(tb, "new.txt", "new\n")
	})
	wantOneError(t, errs, filepath.Join(dir, "new.txt"), "no such file", "rerun the test with -update")
}

func TestStaleFileFails(t *testing.T) {
	dir := dirWith(t, map[string]string{"a.txt": "alpha\n", "old.txt": "old\n", "sub/older.txt": "older\n"})
	errs := run(func(tb testing.TB) {
		Open(tb, dir).CheckString(tb, "a.txt", "alpha\n")
	})
	sort.Strings(errs)
	if len(errs) != 2 || !strings.Contains(errs[0], "stale golden file "+filepath.Join(dir, "old.txt")) ||
		!strings.Contains(errs[1], "stale golden file "+filepath.Join(dir, "sub", "older.txt")) {
		t.Fatalf("failures %q, want old.txt and sub/older.txt reported stale", errs)
	}
}

func TestMissingDirectoryFailsPerFile(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "absent")
	errs := run(func(tb testing.TB) {
		Open(tb, dir).CheckString(tb, "a.txt", "alpha\n")
	})
	wantOneError(t, errs, filepath.Join(dir, "a.txt"), "-update")
}

func TestHint(t *testing.T) {
	dir := dirWith(t, map[string]string{"a.txt": "alpha\n", "stale.txt": ""})
	errs := run(func(tb testing.TB) {
		Open(tb, dir).Hint("make things").CheckString(tb, "a.txt", "beta\n")
	})
	// The test failed, so the stale file is not reported on top.
	wantOneError(t, errs, "make things")
}

func TestUpdateRewritesAndRemovesStale(t *testing.T) {
	dir := dirWith(t, map[string]string{"same.txt": "same\n", "changed.txt": "old\n", "stale.txt": "x\n", "sub/stale.txt": "y\n"})
	errs := run(func(tb testing.TB) {
		d := Open(tb, dir)
		d.update = true
		d.CheckString(tb, "same.txt", "same\n")
		d.CheckString(tb, "changed.txt", "new\n")
		d.CheckString(tb, "sub/added.txt", "added\n")
	})
	if len(errs) != 0 {
		t.Fatalf("failures: %q", errs)
	}
	want := map[string]string{"same.txt": "same\n", "changed.txt": "new\n", "sub/added.txt": "added\n"}
	if got := readAll(t, dir); !reflect.DeepEqual(got, want) {
		t.Fatalf("after -update the directory holds %q, want %q", got, want)
	}
}

func TestFile(t *testing.T) {
	dir := dirWith(t, map[string]string{"doc.md": "doc\n", "unrelated.md": ""})
	if errs := run(func(tb testing.TB) { File(tb, filepath.Join(dir, "doc.md"), []byte("doc\n"), "make doc") }); len(errs) != 0 {
		t.Fatalf("matching file: failures %q (a single file has no stale check)", errs)
	}
	errs := run(func(tb testing.TB) { File(tb, filepath.Join(dir, "doc.md"), []byte("changed\n"), "make doc") })
	wantOneError(t, errs, "doc.md", "make doc", "got:  changed")
	errs = run(func(tb testing.TB) { File(tb, filepath.Join(dir, "none.md"), nil, "") })
	wantOneError(t, errs, "none.md", "rerun the test with -update")
}
