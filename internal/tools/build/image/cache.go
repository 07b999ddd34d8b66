package image

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"

	"github.com/meshcni/meshcni/internal/tools/build/cachedir"
	"github.com/meshcni/meshcni/pkg/fileutil"
)

// cacheKeep is how many archives the cache keeps (the most recently built).
const cacheKeep = 8

// CacheRoot holds the archives Build assembled, one directory per content:
// ${XDG_CACHE_HOME:-$HOME/.cache}/meshcni/image.
func CacheRoot() string { return cachedir.Root("image") }

// assembleCached is Assemble through a cache keyed by everything the archive's bytes
// depend on (Assemble is deterministic): reference, tag, version, revision,
// architectures and each binary's content. A hit copies the cached archive to o.Out;
// an entry that cannot be read is assembled again.
func assembleCached(ctx context.Context, o AssembleOptions) (*Result, bool, error) {
	key, err := assembleKey(o)
	if err != nil {
		return nil, false, err
	}
	dir := filepath.Join(CacheRoot(), "meshcni-"+key)
	hit := cachedir.Complete(dir)
	if !hit {
		err := cachedir.Publish(dir, func(tmp string) error {
			co := o
			co.Out = filepath.Join(tmp, "image.tar")
			res, err := Assemble(ctx, co)
			if err != nil {
				return err
			}
			b, err := json.Marshal(res)
			if err != nil {
				return err
			}
			return os.WriteFile(filepath.Join(tmp, "result.json"), b, 0o644)
		})
		if err != nil {
			return nil, false, err
		}
		pruneCache(CacheRoot(), cacheKeep)
	}
	res, err := fromCache(dir, o.Out)
	if err != nil {
		// Pruned meanwhile by another build (or damaged): assemble it here.
		res, err := Assemble(ctx, o)
		return res, false, err
	}
	return res, hit, nil
}

// assembleKey hashes the inputs of Assemble: the binaries by content.
func assembleKey(o AssembleOptions) (string, error) {
	parts := [][]byte{[]byte("v1"), []byte(o.Ref), []byte(o.Tag), []byte(o.Version), []byte(o.Revision)}
	for _, a := range o.Arches {
		parts = append(parts, []byte(a.String()))
		bins := o.Binaries[a]
		for _, c := range slices.Sorted(maps.Keys(bins)) {
			sum, err := fileSHA256(bins[c])
			if err != nil {
				return "", err
			}
			parts = append(parts, []byte(c), sum)
		}
	}
	return cachedir.Hash(parts...), nil
}

func fileSHA256(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return nil, fmt.Errorf("hash %s: %w", path, err)
	}
	return h.Sum(nil), nil
}

// fromCache copies the cached archive of dir to out and returns its Result.
func fromCache(dir, out string) (*Result, error) {
	b, err := os.ReadFile(filepath.Join(dir, "result.json"))
	if err != nil {
		return nil, err
	}
	var res Result
	if err := json.Unmarshal(b, &res); err != nil {
		return nil, err
	}
	data, err := os.ReadFile(filepath.Join(dir, "image.tar"))
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		return nil, err
	}
	if err := fileutil.WriteFileAtomic(out, data, 0o644); err != nil {
		return nil, err
	}
	res.Out = out
	return &res, nil
}

// pruneCache removes all but the keep most recently published archives of root.
func pruneCache(root string, keep int) {
	entries, err := os.ReadDir(root)
	if err != nil {
		return
	}
	type built struct {
		dir  string
		unix int64
	}
	var all []built
	for _, e := range entries {
		if !e.IsDir() || !strings.HasPrefix(e.Name(), "meshcni-") || strings.Contains(e.Name(), ".tmp-") {
			continue
		}
		st, err := os.Stat(filepath.Join(root, e.Name(), cachedir.Marker))
		if err != nil {
			continue
		}
		all = append(all, built{filepath.Join(root, e.Name()), st.ModTime().UnixNano()})
	}
	sort.Slice(all, func(i, j int) bool { return all[i].unix > all[j].unix })
	for _, b := range all[min(keep, len(all)):] {
		_ = os.RemoveAll(b.dir)
	}
}
