// Package fileutil writes files atomically: a temporary file in the target's directory,
// written, chmod'ed, fsync'ed and renamed over the target, then the directory fsync'ed.
// A concurrent reader sees either the old content or the new one, never a mix.
package fileutil

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"
)

// WriteFileAtomic replaces path with data, with permission bits mode (not masked by
// the umask).
func WriteFileAtomic(path string, data []byte, mode os.FileMode) error {
	return WriteAtomic(path, bytes.NewReader(data), mode, nil)
}

// WriteAtomic replaces path with the content of r, with permission bits mode. When
// precondition is not nil it runs after the temporary file is complete and synced,
// right before the rename: an error from it aborts the write (the temporary file is
// removed) and is returned as is, so a caller can detect a concurrent change of the
// target and retry.
func WriteAtomic(path string, r io.Reader, mode os.FileMode, precondition func() error) (err error) {
	dir, base := filepath.Split(path)
	if dir == "" {
		dir = "."
	}
	f, err := os.CreateTemp(dir, "."+base+".tmp-*")
	if err != nil {
		return fmt.Errorf("create temporary file for %s: %w", path, err)
	}
	tmp := f.Name()
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(tmp)
		}
	}()
	if _, err = io.Copy(f, r); err != nil {
		return fmt.Errorf("write %s: %w", tmp, err)
	}
	if err = f.Chmod(mode.Perm()); err != nil {
		return fmt.Errorf("chmod %s: %w", tmp, err)
	}
	if err = f.Sync(); err != nil {
		return fmt.Errorf("fsync %s: %w", tmp, err)
	}
	if err = f.Close(); err != nil {
		return fmt.Errorf("close %s: %w", tmp, err)
	}
	if precondition != nil {
		if err = precondition(); err != nil {
			return err
		}
	}
	if err = os.Rename(tmp, path); err != nil {
		return fmt.Errorf("rename %s to %s: %w", tmp, path, err)
	}
	// The rename is durable once the directory entry is.
	if d, derr := os.Open(dir); derr == nil {
		_ = d.Sync()
		d.Close()
	}
	return nil
}
