package testbed

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// HostBPFFS is where a node has its bpffs: systemd mounts one there at boot, and
// eBPF programs that must outlive their loader (meshcni's acceleration) pin there.
const HostBPFFS = "/sys/fs/bpf"

// bpffsMarker records that Start mounted HostBPFFS (the host had none), so that
// cleanup unmounts it and leaves the machine as it found it.
var bpffsMarker = filepath.Join(BaseDir, "host-bpffs-mounted")

// ensureHostBPFFS gives the host a bpffs at HostBPFFS, as a real node has, when it
// has none: mounted shared (as systemd mounts everything) and recorded in
// bpffsMarker. A bpffs already there is the host's own and left alone.
func ensureHostBPFFS() error {
	if isBPFFS(HostBPFFS) {
		return nil
	}
	if err := os.MkdirAll(HostBPFFS, 0o755); err != nil {
		return fmt.Errorf("create %s: %w", HostBPFFS, err)
	}
	if err := os.WriteFile(bpffsMarker, nil, 0o644); err != nil {
		return fmt.Errorf("record the test bed's bpffs: %w", err)
	}
	if err := unix.Mount("bpf", HostBPFFS, "bpf", 0, "mode=0700"); err != nil {
		_ = os.Remove(bpffsMarker)
		return fmt.Errorf("mount a bpffs at %s (a node's, as systemd mounts it): %w", HostBPFFS, err)
	}
	if err := unix.Mount("", HostBPFFS, "", unix.MS_SHARED, ""); err != nil {
		return fmt.Errorf("make %s a shared mount: %w", HostBPFFS, err)
	}
	return nil
}

// removeHostBPFFS unmounts the bpffs ensureHostBPFFS mounted (nothing when the
// host had its own). What is pinned on it goes with it.
func removeHostBPFFS() error {
	if _, err := os.Stat(bpffsMarker); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	for isBPFFS(HostBPFFS) {
		if err := unix.Unmount(HostBPFFS, unix.MNT_DETACH); err != nil {
			return fmt.Errorf("unmount the test bed's bpffs at %s: %w", HostBPFFS, err)
		}
	}
	if err := os.Remove(bpffsMarker); err != nil {
		return fmt.Errorf("remove %s: %w", bpffsMarker, err)
	}
	return nil
}

// hostBPFFSLeft says whether the bpffs the test bed mounted is still there.
func hostBPFFSLeft() bool {
	_, err := os.Stat(bpffsMarker)
	return err == nil && isBPFFS(HostBPFFS)
}

func isBPFFS(dir string) bool {
	var st unix.Statfs_t
	return unix.Statfs(dir, &st) == nil && st.Type == unix.BPF_FS_MAGIC
}
