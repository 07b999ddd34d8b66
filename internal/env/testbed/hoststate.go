package testbed

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// hostSysctls are the host's settings that running pods change (the bridge CNI
// plugin turns forwarding on, as it does on a node): Start records them and
// cleanup puts them back, so a machine is left as the test bed found it.
var hostSysctls = []string{
	"/proc/sys/net/ipv4/ip_forward",
	"/proc/sys/net/ipv6/conf/all/forwarding",
}

// sysctlsFile holds the values of hostSysctls as Start found them.
var sysctlsFile = filepath.Join(BaseDir, "host-sysctls.json")

// recordHostSysctls writes hostSysctls' values to sysctlsFile, unless a crashed
// test bed's record is still there (cleanup restores from it first).
func recordHostSysctls() error {
	vals := map[string]string{}
	for _, p := range hostSysctls {
		b, err := os.ReadFile(p)
		if err != nil {
			continue // e.g. IPv6 disabled: nothing to restore
		}
		vals[p] = string(bytes.TrimSpace(b))
	}
	b, err := json.Marshal(vals)
	if err != nil {
		return err
	}
	tmp := sysctlsFile + ".tmp"
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return fmt.Errorf("record the host's sysctls: %w", err)
	}
	return os.Rename(tmp, sysctlsFile)
}

// restoreHostSysctls puts back what recordHostSysctls recorded.
func restoreHostSysctls() error {
	b, err := os.ReadFile(sysctlsFile)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var vals map[string]string
	if err := json.Unmarshal(b, &vals); err != nil {
		return fmt.Errorf("%s: %w", sysctlsFile, err)
	}
	var errs []error
	for _, p := range hostSysctls { // only the known files, whatever the record says
		if v, ok := vals[p]; ok {
			if err := os.WriteFile(p, []byte(v), 0o644); err != nil {
				errs = append(errs, fmt.Errorf("restore %s=%s: %w", p, v, err))
			}
		}
	}
	if len(errs) == 0 {
		errs = append(errs, os.Remove(sysctlsFile))
	}
	return errors.Join(errs...)
}

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
