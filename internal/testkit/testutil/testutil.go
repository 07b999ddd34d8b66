// Package testutil holds helpers shared by meshcni's tests: the CI skip policy and
// throwaway network namespaces.
//
// The policy: a test that needs root, a binary or a built component may skip only
// outside CI. When CI=true, a missing requirement fails the test instead.
//
// Short mode (go test -short, `make unit`) means "unit tests only": every test that
// needs root, a program on PATH or a built component skips, also under CI=true.
// `make e2e` runs them without -short.
package testutil

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync/atomic"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/pkg/netnsutil"
)

// InCI reports whether the tests run under CI (CI=true).
func InCI() bool { return os.Getenv("CI") == "true" }

// Unit skips the test in short mode (unit tests only), CI or not: it needs what a
// unit test has not (root, a program, a built component, the test bed).
func Unit(t testing.TB, needs string) {
	t.Helper()
	if testing.Short() {
		t.Skipf("skipped in -short mode (unit tests only): test needs %s", needs)
	}
}

// Missing skips the test outside CI and fails it under CI, with the reason. In
// short mode it always skips.
func Missing(t testing.TB, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	Unit(t, msg)
	if InCI() {
		t.Fatalf("required under CI=true: %s", msg)
	}
	t.Skipf("skipped outside CI: %s", msg)
}

// RequireRoot needs uid 0 (network namespaces, rules, setuid listeners). It skips
// in short mode even as root.
func RequireRoot(t testing.TB) {
	t.Helper()
	Unit(t, "root")
	if os.Geteuid() != 0 {
		Missing(t, "test needs root")
	}
}

// RequireBinary returns the path of a program on PATH, or skips/fails. It skips in
// short mode even when the program is there.
func RequireBinary(t testing.TB, name string) string {
	t.Helper()
	Unit(t, fmt.Sprintf("program %q", name))
	p, err := exec.LookPath(name)
	if err != nil {
		Missing(t, "program %q not found on PATH", name)
	}
	return p
}

// SharedDir returns ../shared/<rel> from the repository root, or skips/fails when it
// is absent (a user's clone has no ../shared).
func SharedDir(t testing.TB, rel string) string {
	t.Helper()
	root, err := RepoRoot()
	if err != nil {
		t.Fatalf("repo root: %v", err)
	}
	p := filepath.Join(filepath.Dir(root), "shared", rel)
	if _, err := os.Stat(p); err != nil {
		Missing(t, "shared data %s is missing: %v", p, err)
	}
	return p
}

// RepoRoot finds the directory holding go.mod, walking up from the working directory.
func RepoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", fmt.Errorf("no go.mod above the working directory")
		}
		dir = parent
	}
}

var nsCounter atomic.Uint64

// NewNetns creates a fresh named network namespace (bind-mounted under /run/netns, so
// `ip netns` and `nsenter` see it) with loopback up, and removes it when the test ends.
// It returns the namespace's path.
func NewNetns(t testing.TB) string {
	t.Helper()
	RequireRoot(t)
	name := fmt.Sprintf("mcni-t%d-%d", os.Getpid(), nsCounter.Add(1))
	path, err := CreateNetns(name)
	if err != nil {
		t.Fatalf("create netns: %v", err)
	}
	t.Cleanup(func() {
		if err := DeleteNetns(path); err != nil {
			t.Errorf("delete netns %s: %v", path, err)
		}
	})
	return path
}

// CreateNetns creates /run/netns/<name> the way `ip netns add` does and brings lo up.
func CreateNetns(name string) (string, error) {
	const dir = "/run/netns"
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	path := filepath.Join(dir, name)
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_RDONLY, 0o444)
	if err != nil {
		return "", fmt.Errorf("create %s: %w", path, err)
	}
	f.Close()

	errc := make(chan error, 1)
	go func() {
		// A fresh thread: unshare its netns, bind-mount it, and let the thread die
		// (never UnlockOSThread) so no goroutine inherits the new namespace.
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("unshare: %w", err)
			return
		}
		src := fmt.Sprintf("/proc/%d/task/%d/ns/net", os.Getpid(), unix.Gettid())
		if err := unix.Mount(src, path, "none", unix.MS_BIND, ""); err != nil {
			errc <- fmt.Errorf("bind mount %s: %w", src, err)
			return
		}
		errc <- nil
	}()
	if err := <-errc; err != nil {
		os.Remove(path)
		return "", err
	}
	if err := netnsutil.Do(path, func() error { return LinkUp("lo") }); err != nil {
		_ = DeleteNetns(path)
		return "", err
	}
	return path, nil
}

// DeleteNetns unmounts and removes a namespace made by CreateNetns.
func DeleteNetns(path string) error {
	if err := unix.Unmount(path, unix.MNT_DETACH); err != nil && err != unix.EINVAL && err != unix.ENOENT {
		return fmt.Errorf("unmount %s: %w", path, err)
	}
	if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
		return err
	}
	return nil
}
