package testutil

import (
	"errors"
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

// BPFFS mounts a bpffs of the test's own on a new temporary directory and returns
// it; the test's cleanup unmounts and removes it. Pins made under it are the
// test's alone and never depend on, nor leave, a bpffs at /sys/fs/bpf.
func BPFFS(t testing.TB) string {
	t.Helper()
	RequireRoot(t)
	dir, err := os.MkdirTemp("", "mcni-bpffs-")
	if err != nil {
		t.Fatalf("bpffs mount point: %v", err)
	}
	if err := unix.Mount("bpf", dir, "bpf", 0, "mode=0700"); err != nil {
		_ = os.Remove(dir)
		if errors.Is(err, unix.ENODEV) {
			Missing(t, "this kernel has no bpffs: %v", err)
		}
		t.Fatalf("mount bpffs at %s: %v", dir, err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
			t.Errorf("unmount bpffs %s: %v", dir, err)
		}
		if err := os.Remove(dir); err != nil {
			t.Errorf("remove %s: %v", dir, err)
		}
	})
	return dir
}
