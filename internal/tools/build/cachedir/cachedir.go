// Package cachedir keeps what the project builds for its tests and demo (Kubernetes,
// Istio, their images) under ${XDG_CACHE_HOME:-$HOME/.cache}/meshcni/<kind>/, one
// directory per build keyed by a hash of its inputs, each published whole or not at
// all: filled in a temporary sibling, marked complete, renamed into place.
package cachedir

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"time"
)

// Marker is the file a published directory holds; a directory without it is not a
// build (an interrupted one is never renamed into place).
const Marker = ".complete"

// Root is ${XDG_CACHE_HOME:-$HOME/.cache}/meshcni/<kind>.
func Root(kind string) string {
	base := os.Getenv("XDG_CACHE_HOME")
	if base == "" {
		home, err := os.UserHomeDir()
		if err != nil || home == "" {
			home = "/root"
		}
		base = filepath.Join(home, ".cache")
	}
	return filepath.Join(base, "meshcni", kind)
}

// Hash is a short hash of the inputs of a build (each part length-prefixed, so
// parts cannot run into each other).
func Hash(parts ...[]byte) string {
	h := sha256.New()
	for _, p := range parts {
		fmt.Fprintf(h, "%d:", len(p))
		h.Write(p)
	}
	return hex.EncodeToString(h.Sum(nil))[:16]
}

// Complete reports whether dir is a published build.
func Complete(dir string) bool {
	_, err := os.Stat(filepath.Join(dir, Marker))
	return err == nil
}

// Publish fills a fresh temporary sibling of dir with fill, marks it complete and
// renames it into place (0755). When another build published dir meanwhile, that
// one stays and this one is dropped.
func Publish(dir string, fill func(tmp string) error) error {
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		return err
	}
	tmp, err := os.MkdirTemp(filepath.Dir(dir), filepath.Base(dir)+".tmp-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	if err := fill(tmp); err != nil {
		return err
	}
	if Complete(dir) {
		return nil // a concurrent build published it first
	}
	if err := os.WriteFile(filepath.Join(tmp, Marker), []byte(time.Now().UTC().Format(time.RFC3339)+"\n"), 0o644); err != nil {
		return err
	}
	if err := os.Chmod(tmp, 0o755); err != nil {
		return err
	}
	_ = os.RemoveAll(dir)
	if err := os.Rename(tmp, dir); err != nil {
		return fmt.Errorf("publish %s: %w", dir, err)
	}
	return nil
}
