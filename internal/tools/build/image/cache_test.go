package image

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"reflect"
	"testing"
)

// TestAssembleCached: the cached archive is the one Assemble writes, byte for byte,
// with the same Result; a changed binary misses; the cache keeps cacheKeep archives.
func TestAssembleCached(t *testing.T) {
	t.Setenv("XDG_CACHE_HOME", t.TempDir())
	arches := []Arch{{GOARCH: "amd64"}}
	bins := fakeBinaries(t, arches)
	dir := t.TempDir()
	opts := AssembleOptions{
		Ref: "meshcni.local/meshcni:t1", Tag: "t1", Version: "v1.2.3", Revision: "abc123",
		Arches: arches, Binaries: bins, Out: filepath.Join(dir, "direct.tar"),
	}
	want, err := Assemble(context.Background(), opts)
	if err != nil {
		t.Fatal(err)
	}
	wantBytes, _ := os.ReadFile(opts.Out)
	for i, wantHit := range []bool{false, true} {
		o := opts
		o.Out = filepath.Join(dir, "out", "cached.tar")
		got, hit, err := assembleCached(context.Background(), o)
		if err != nil {
			t.Fatal(err)
		}
		gotBytes, _ := os.ReadFile(o.Out)
		w := *want
		w.Out = o.Out
		if hit != wantHit || !reflect.DeepEqual(*got, w) || !bytes.Equal(gotBytes, wantBytes) {
			t.Errorf("build %d: hit %v (want %v), result %+v (want %+v), archive equal %v", i, hit, wantHit, got, w, bytes.Equal(gotBytes, wantBytes))
		}
	}

	// A binary's content changes: a miss, another archive.
	for c, p := range bins[arches[0]] {
		if err := os.WriteFile(p, []byte("changed "+c), 0o755); err != nil {
			t.Fatal(err)
		}
		break
	}
	o := opts
	o.Out = filepath.Join(dir, "changed.tar")
	got, hit, err := assembleCached(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	if hit || got.IndexDigest == want.IndexDigest {
		t.Errorf("changed binary: hit %v, digest %s (unchanged %s)", hit, got.IndexDigest, want.IndexDigest)
	}

	for i := range cacheKeep + 2 {
		o.Revision = string(rune('a' + i))
		if _, _, err := assembleCached(context.Background(), o); err != nil {
			t.Fatal(err)
		}
	}
	entries, err := os.ReadDir(CacheRoot())
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != cacheKeep {
		t.Errorf("%d entries in the cache, want %d", len(entries), cacheKeep)
	}
}
