// Package install puts the meshcni plugin's files on the node and takes them off again:
// its binaries in the CNI bin directory (Binary), its kubeconfig in the agent's run
// directory (Kubeconfig, from the in-cluster credentials, a file or a minted token) and
// its entry in the node's CNI configuration (InstallConflist). Each has Install, Check
// and Remove; the agent's guard (pkg/agent) is the watch loop that calls them.
package install

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sync"

	"github.com/meshcni/meshcni/pkg/fileutil"
)

// Binary copies the plugin binary Src to Dst, and its companions (files of Src's
// directory, such as the API helper meshcni-podget) into Dst's directory.
type Binary struct {
	Src, Dst string
	// Companions are file names installed from Src's directory into Dst's before Src
	// (so the plugin is never in place without them) and removed after it.
	Companions []string

	mu    sync.Mutex
	cache map[string]hashed // path → last hash, valid while the file's identity holds
}

// fileID is a file's identity (device, inode, size, mtime): a cached hash or read
// holds while it does.
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
	id := idOf(fi)
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

// file is one source → destination pair.
type file struct{ src, dst, what string }

// files lists the companions, then the plugin binary itself: the install order.
func (b *Binary) files() []file {
	out := make([]file, 0, len(b.Companions)+1)
	for _, name := range b.Companions {
		out = append(out, file{filepath.Join(filepath.Dir(b.Src), name), filepath.Join(filepath.Dir(b.Dst), name), "plugin companion " + name})
	}
	return append(out, file{b.Src, b.Dst, "plugin binary"})
}

// Dsts lists the installed paths: the companions', then Dst.
func (b *Binary) Dsts() []string {
	var out []string
	for _, f := range b.files() {
		out = append(out, f.dst)
	}
	return out
}

// Install copies Src to Dst (mode 0755, temp file + rename), after its companions,
// unless each destination already holds the same content. It reports whether it
// wrote.
func (b *Binary) Install() (bool, error) {
	files := b.files()
	if err := b.sources(files); err != nil {
		return false, err
	}
	wrote := false
	for _, f := range files {
		w, err := b.install(f)
		if err != nil {
			return wrote, err
		}
		wrote = wrote || w
	}
	return wrote, nil
}

// sources checks that every source is readable, the plugin's first (its absence is
// the likelier and the more telling error).
func (b *Binary) sources(files []file) error {
	for i := len(files) - 1; i >= 0; i-- {
		if _, _, err := b.hash(files[i].src); err != nil {
			return fmt.Errorf("%s source: %w", files[i].what, err)
		}
	}
	return nil
}

func (b *Binary) install(f file) (bool, error) {
	err := b.check(f)
	if err == nil {
		return false, nil
	}
	if !errors.Is(err, ErrDiffers) && !errors.Is(err, fs.ErrNotExist) {
		return false, err
	}
	src, err := os.ReadFile(f.src)
	if err != nil {
		return false, fmt.Errorf("%s source: %w", f.what, err)
	}
	if err := fileutil.WriteAtomic(f.dst, bytes.NewReader(src), 0o755, nil); err != nil {
		return false, fmt.Errorf("install %s: %w", f.what, err)
	}
	return true, nil
}

// Check returns nil when Dst (and each companion) is an executable file with its
// source's content.
func (b *Binary) Check() error {
	files := b.files()
	if err := b.sources(files); err != nil {
		return err
	}
	for _, f := range files {
		if err := b.check(f); err != nil {
			return err
		}
	}
	return nil
}

func (b *Binary) check(f file) error {
	want, _, err := b.hash(f.src)
	if err != nil {
		return fmt.Errorf("%s source: %w", f.what, err)
	}
	fi, err := os.Lstat(f.dst)
	if err != nil {
		return fmt.Errorf("installed %s: %w", f.what, err)
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("installed %s %s is not a regular file (%v): %w", f.what, f.dst, fi.Mode().Type(), ErrDiffers)
	}
	if fi.Mode().Perm()&0o111 == 0 {
		return fmt.Errorf("installed %s %s is not executable (%v): %w", f.what, f.dst, fi.Mode().Perm(), ErrDiffers)
	}
	have, _, err := b.hash(f.dst)
	if err != nil {
		return fmt.Errorf("installed %s: %w", f.what, err)
	}
	if have != want {
		return fmt.Errorf("%s: %w", f.dst, ErrDiffers)
	}
	return nil
}

// Remove deletes Dst, then its companions; a missing file is no error.
func (b *Binary) Remove() error {
	files := b.files()
	var errs []error
	for i := len(files) - 1; i >= 0; i-- {
		if err := os.Remove(files[i].dst); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, fmt.Errorf("remove %s: %w", files[i].what, err))
		}
	}
	return errors.Join(errs...)
}
