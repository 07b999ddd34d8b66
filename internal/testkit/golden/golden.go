// Package golden compares test output with golden files, for every golden test of
// meshcni. `go test ./pkg/x -update` rewrites the files.
//
// Both ways are checked: a golden file a test case wants but that does not exist
// fails (with the hint to run -update), and, in a golden directory (Open), a file no
// test case checked is stale and fails too; -update removes it.
package golden

import (
	"bytes"
	"flag"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"

	"github.com/meshcni/meshcni/pkg/fileutil"
)

var update = flag.Bool("update", false, "rewrite golden files (internal/testkit/golden)")

// Update reports whether the test binary runs with -update.
func Update() bool { return *update }

// Dir is a directory of golden files that one test owns entirely: every regular
// file under it (subdirectories included) must be checked by that test or its
// subtests.
type Dir struct {
	path   string
	hint   string
	update bool

	mu   sync.Mutex
	seen map[string]bool
}

// Open starts checking the golden directory path for test t. When t and its
// subtests end, a file under path that no Check named is reported as stale (or
// removed under -update). The check is left out when the test failed or skipped,
// or when -run/-skip select subtests (then not every case ran). A test whose cases
// may skip (a missing program, data) calls its skip gates before Open, so that the
// whole test skips rather than some cases.
func Open(t testing.TB, path string) *Dir {
	t.Helper()
	d := &Dir{path: path, hint: "rerun the test with -update", update: *update, seen: map[string]bool{}}
	t.Cleanup(func() { d.finish(t) })
	return d
}

// Hint replaces the "rerun the test with -update" hint, e.g. by a make target.
func (d *Dir) Hint(hint string) *Dir { d.hint = hint; return d }

// Check compares got with the golden file name (a slash-separated path relative to
// the directory), or writes it under -update.
func (d *Dir) Check(t testing.TB, name string, got []byte) {
	t.Helper()
	d.mu.Lock()
	d.seen[filepath.FromSlash(name)] = true
	d.mu.Unlock()
	check(t, filepath.Join(d.path, filepath.FromSlash(name)), got, d.update, d.hint)
}

// CheckString is Check for text.
func (d *Dir) CheckString(t testing.TB, name, got string) {
	t.Helper()
	d.Check(t, name, []byte(got))
}

// File compares got with one golden file outside any golden directory (no stale
// check), or writes it under -update. hint says how to rewrite it ("" for -update).
func File(t testing.TB, path string, got []byte, hint string) {
	t.Helper()
	if hint == "" {
		hint = "rerun the test with -update"
	}
	check(t, path, got, *update, hint)
}

func check(t testing.TB, path string, got []byte, update bool, hint string) {
	t.Helper()
	if update {
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatalf("golden: %v", err)
		}
		if err := fileutil.WriteFileAtomic(path, got, 0o644); err != nil {
			t.Fatalf("golden: %v", err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("golden file %s: %v (%s)", path, err, hint)
		return
	}
	if !bytes.Equal(got, want) {
		t.Errorf("output differs from golden file %s (%s):\n%s", path, hint, firstDiff(string(got), string(want)))
	}
}

// finish reports (or, under -update, removes) the files no Check named.
func (d *Dir) finish(t testing.TB) {
	t.Helper()
	if t.Failed() || t.Skipped() || subtestsFiltered() {
		return
	}
	stale, err := d.stale()
	if err != nil {
		t.Errorf("golden: %v", err)
		return
	}
	for _, rel := range stale {
		p := filepath.Join(d.path, rel)
		if d.update {
			if err := os.Remove(p); err != nil {
				t.Errorf("golden: remove stale file: %v", err)
			}
			continue
		}
		t.Errorf("stale golden file %s: no test case produced it (%s to remove it)", p, d.hint)
	}
}

// stale lists the regular files under the directory that no Check named, sorted.
func (d *Dir) stale() ([]string, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	var out []string
	err := filepath.WalkDir(d.path, func(p string, e fs.DirEntry, err error) error {
		if err != nil {
			if os.IsNotExist(err) && p == d.path {
				return nil
			}
			return err
		}
		if !e.Type().IsRegular() {
			return nil
		}
		rel, err := filepath.Rel(d.path, p)
		if err != nil {
			return err
		}
		if !d.seen[rel] {
			out = append(out, rel)
		}
		return nil
	})
	sort.Strings(out)
	return out, err
}

// subtestsFiltered reports whether -run or -skip may have left out subtests.
func subtestsFiltered() bool {
	run, skip := flag.Lookup("test.run"), flag.Lookup("test.skip")
	return (run != nil && strings.Contains(run.Value.String(), "/")) || (skip != nil && skip.Value.String() != "")
}

// firstDiff shows the first differing line with a little context.
func firstDiff(got, want string) string {
	g, w := strings.Split(got, "\n"), strings.Split(want, "\n")
	for i := 0; i < len(g) || i < len(w); i++ {
		if i < len(g) && i < len(w) && g[i] == w[i] {
			continue
		}
		var sb strings.Builder
		fmt.Fprintf(&sb, "first difference at line %d:\n", i+1)
		fmt.Fprintf(&sb, "  got:  %s\n", lines(g, i, 3))
		fmt.Fprintf(&sb, "  want: %s", lines(w, i, 3))
		return sb.String()
	}
	return "(identical lines, different bytes)"
}

func lines(ls []string, from, n int) string {
	if from >= len(ls) {
		return "(end of text)"
	}
	to := min(from+n, len(ls))
	return strings.Join(ls[from:to], "\n        ")
}
