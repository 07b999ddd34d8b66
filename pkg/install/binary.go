// Package install puts the meshcni plugin's files on the node: its binary in the CNI
// bin directory and its kubeconfig in the agent's run directory.
package install

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"sync"
	"syscall"

	"github.com/meshcni/meshcni/pkg/fileutil"
)

// Binary copies the plugin binary Src to Dst.
type Binary struct {
	Src, Dst string

	mu    sync.Mutex
	cache map[string]hashed // path → last hash, valid while the file's identity holds
}

type fileID struct {
	dev, ino uint64
	size     int64
	mtime    int64
}

type hashed struct {
	id  fileID
	sum [sha256.Size]byte
}

// ErrDiffers: the installed binary is not the source's content.
var ErrDiffers = errors.New("installed binary differs from the source")

func (b *Binary) hash(path string) ([sha256.Size]byte, fileID, error) {
	var sum [sha256.Size]byte
	f, err := os.Open(path)
	if err != nil {
		return sum, fileID{}, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return sum, fileID{}, err
	}
	if !fi.Mode().IsRegular() {
		return sum, fileID{}, fmt.Errorf("%s is not a regular file", path)
	}
	id := fileID{size: fi.Size(), mtime: fi.ModTime().UnixNano()}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		id.dev, id.ino = uint64(st.Dev), st.Ino
	}
	b.mu.Lock()
	c, ok := b.cache[path]
	b.mu.Unlock()
	if ok && c.id == id {
		return c.sum, id, nil
	}
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return sum, id, fmt.Errorf("read %s: %w", path, err)
	}
	copy(sum[:], h.Sum(nil))
	b.mu.Lock()
	if b.cache == nil {
		b.cache = map[string]hashed{}
	}
	b.cache[path] = hashed{id: id, sum: sum}
	b.mu.Unlock()
	return sum, id, nil
}

// Install copies Src to Dst (mode 0755, temp file + rename) unless Dst already holds
// the same content. It reports whether it wrote.
func (b *Binary) Install() (bool, error) {
	if _, _, err := b.hash(b.Src); err != nil {
		return false, fmt.Errorf("plugin binary source: %w", err)
	}
	err := b.Check()
	if err == nil {
		return false, nil
	}
	if !errors.Is(err, ErrDiffers) && !errors.Is(err, fs.ErrNotExist) {
		return false, err
	}
	src, err := os.ReadFile(b.Src)
	if err != nil {
		return false, fmt.Errorf("plugin binary source: %w", err)
	}
	if err := fileutil.WriteAtomic(b.Dst, bytes.NewReader(src), 0o755, nil); err != nil {
		return false, fmt.Errorf("install plugin binary: %w", err)
	}
	return true, nil
}

// Check returns nil when Dst is an executable file with Src's content.
func (b *Binary) Check() error {
	want, _, err := b.hash(b.Src)
	if err != nil {
		return fmt.Errorf("plugin binary source: %w", err)
	}
	fi, err := os.Stat(b.Dst)
	if err != nil {
		return fmt.Errorf("installed plugin binary: %w", err)
	}
	if fi.Mode().Perm()&0o111 == 0 {
		return fmt.Errorf("installed plugin binary %s is not executable (%v): %w", b.Dst, fi.Mode().Perm(), ErrDiffers)
	}
	have, _, err := b.hash(b.Dst)
	if err != nil {
		return fmt.Errorf("installed plugin binary: %w", err)
	}
	if have != want {
		return fmt.Errorf("%s: %w", b.Dst, ErrDiffers)
	}
	return nil
}

// Remove deletes Dst; a missing file is no error.
func (b *Binary) Remove() error {
	if err := os.Remove(b.Dst); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove plugin binary: %w", err)
	}
	return nil
}
