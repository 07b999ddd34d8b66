package sockmap

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/btf"
	"github.com/cilium/ebpf/features"
	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/pkg/netnsutil"
)

// ErrUnavailable is wrapped by Detect's (and Load's) error when this node cannot
// run the acceleration; the error says why. Pods are then redirected as without it.
var ErrUnavailable = errors.New("eBPF acceleration unavailable")

// Features is what Detect found.
type Features struct {
	Kernel  string // uname release
	Cgroup2 string // the cgroup2 directory sockops attaches to (mounted if needed)
}

// Detect checks, in order, that this node can run the acceleration: the forced
// setting, the map and program types and helpers, the programs passing the
// verifier, a bpffs under the pin directory (mounted when absent only with
// Options.MountBPFFS) and a cgroup2 hierarchy. The error wraps ErrUnavailable and
// names the first missing piece.
func Detect(opts Options) (Features, error) {
	var f Features
	var u unix.Utsname
	if err := unix.Uname(&u); err == nil {
		f.Kernel = unix.ByteSliceToString(u.Release[:])
	}
	if err := forced(opts); err != nil {
		return f, err
	}
	for _, c := range []struct {
		what string
		err  func() error
	}{
		{"map type SOCKHASH", func() error { return features.HaveMapType(ebpf.SockHash) }},
		{"map type SK_STORAGE", func() error { return features.HaveMapType(ebpf.SkStorage) }},
		{"program type SOCK_OPS", func() error { return features.HaveProgramType(ebpf.SockOps) }},
		{"program type SK_MSG", func() error { return features.HaveProgramType(ebpf.SkMsg) }},
		{"helper bpf_get_netns_cookie in SOCK_OPS (Linux 5.15)", func() error { return features.HaveProgramHelper(ebpf.SockOps, asm.FnGetNetnsCookie) }},
		{"helper bpf_sk_storage_get in SK_MSG", func() error { return features.HaveProgramHelper(ebpf.SkMsg, asm.FnSkStorageGet) }},
		{"kernel BTF with struct sock's sk_uid", func() error { _, err := skUIDOffset(); return err }},
		{"the programs passing the verifier", verify},
	} {
		if err := c.err(); err != nil {
			return f, fmt.Errorf("%w on kernel %s: %s: %v", ErrUnavailable, f.Kernel, c.what, err)
		}
	}
	if err := ensureBPFFS(opts.pinDir(), opts.MountBPFFS); err != nil {
		return f, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	cg, err := cgroup2Dir(opts)
	if err != nil {
		return f, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	f.Cgroup2 = cg
	return f, nil
}

func forced(opts Options) error {
	if opts.ForceUnavailable != "" {
		return fmt.Errorf("%w: forced by setting: %s", ErrUnavailable, opts.ForceUnavailable)
	}
	return nil
}

// skUIDOffset is the byte offset of sk_uid in the running kernel's struct sock
// (its BTF), read by sockops to leave the proxy's own sockets alone.
func skUIDOffset() (int16, error) {
	kspec, err := btf.LoadKernelSpec()
	if err != nil {
		return 0, err
	}
	var sock *btf.Struct
	if err := kspec.TypeByName("sock", &sock); err != nil {
		return 0, err
	}
	if off, ok := memberOffset(sock.Members, "sk_uid"); ok {
		return int16(off), nil
	}
	return 0, fmt.Errorf("struct sock has no sk_uid")
}

// memberOffset finds a member by name, also inside anonymous structs and unions.
func memberOffset(ms []btf.Member, name string) (uint32, bool) {
	for _, m := range ms {
		if m.Name == name {
			return m.Offset.Bytes(), true
		}
		if m.Name != "" {
			continue
		}
		var inner []btf.Member
		switch t := btf.UnderlyingType(m.Type).(type) {
		case *btf.Struct:
			inner = t.Members
		case *btf.Union:
			inner = t.Members
		}
		if off, ok := memberOffset(inner, name); ok {
			return m.Offset.Bytes() + off, true
		}
	}
	return 0, false
}

// loadSpec is spec for the running kernel.
func loadSpec() (*ebpf.CollectionSpec, error) {
	off, err := skUIDOffset()
	if err != nil {
		return nil, fmt.Errorf("kernel BTF: %w", err)
	}
	return spec(off), nil
}

// verify loads the collection and throws it away.
func verify() error {
	cs, err := loadSpec()
	if err != nil {
		return err
	}
	coll, err := ebpf.NewCollection(cs)
	if err != nil {
		return err
	}
	coll.Close()
	return nil
}

// ensureBPFFS makes sure the pin directory lies on a bpffs. Where it does not,
// it mounts one at DefaultBPFFS if mount is set and that is where it should be
// (the pin directory under it, nothing mounted there); else the error says what
// the node lacks and what to do.
func ensureBPFFS(pinDir string, mount bool) error {
	dir := existingParent(pinDir)
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return fmt.Errorf("statfs %s: %w", dir, err)
	}
	if st.Type == unix.BPF_FS_MAGIC {
		return nil
	}
	underDefault := strings.HasPrefix(pinDir, DefaultBPFFS+"/") && (dir == DefaultBPFFS || dir == filepath.Dir(DefaultBPFFS))
	if !mount || !underDefault {
		hint := "mount a bpffs on the host, as systemd does at boot (mount -t bpf bpf " + DefaultBPFFS + ")"
		if !underDefault {
			hint = "choose a pin directory on the node's bpffs"
		}
		return fmt.Errorf("pin directory %s is not on a bpffs (%s is %s): %s", pinDir, dir, fsName(st.Type), hint)
	}
	if err := os.MkdirAll(DefaultBPFFS, 0o700); err != nil {
		return fmt.Errorf("create %s: %w", DefaultBPFFS, err)
	}
	if err := unix.Mount("bpf", DefaultBPFFS, "bpf", 0, "mode=0700"); err != nil {
		return fmt.Errorf("mount bpffs at %s: %w", DefaultBPFFS, err)
	}
	return nil
}

// existingParent is the longest existing prefix of path ("/" at worst).
func existingParent(path string) string {
	for {
		if _, err := os.Stat(path); err == nil || path == filepath.Dir(path) {
			return path
		}
		path = filepath.Dir(path)
	}
}

// fsName names the filesystem types a pin directory is found on instead of a bpffs.
func fsName(magic int64) string {
	switch magic {
	case unix.TMPFS_MAGIC:
		return "a tmpfs"
	case unix.SYSFS_MAGIC:
		return "sysfs (nothing mounted there)"
	case unix.EXT4_SUPER_MAGIC:
		return "ext4"
	case unix.OVERLAYFS_SUPER_MAGIC:
		return "an overlay (a container's own filesystem: mount the host's bpffs in)"
	}
	return fmt.Sprintf("filesystem type %#x", magic)
}

// cgroup2Dir returns opts.Cgroup2 — or its "unified" subdirectory, where a cgroup
// v1 hybrid host (systemd's layout) mounts its cgroup2 under /sys/fs/cgroup — else
// the root of the host's cgroup2 mount, else mounts one at DefaultCgroup2 (next to
// cgroup v1 hierarchies this is the unified hierarchy every socket also belongs to).
func cgroup2Dir(opts Options) (string, error) {
	if opts.Cgroup2 != "" {
		for _, d := range []string{opts.Cgroup2, filepath.Join(opts.Cgroup2, "unified")} {
			var st unix.Statfs_t
			if err := unix.Statfs(d, &st); err == nil && st.Type == unix.CGROUP2_SUPER_MAGIC {
				return d, nil
			}
		}
		return "", fmt.Errorf("%s is not a cgroup2 directory, nor is its unified/", opts.Cgroup2)
	}
	if p, err := cgroup2Mount(); err != nil || p != "" {
		return p, err
	}
	if err := os.MkdirAll(DefaultCgroup2, 0o755); err != nil {
		return "", fmt.Errorf("create %s: %w", DefaultCgroup2, err)
	}
	if err := unix.Mount("cgroup2", DefaultCgroup2, "cgroup2", 0, ""); err != nil {
		return "", fmt.Errorf("mount cgroup2 at %s: %w", DefaultCgroup2, err)
	}
	return DefaultCgroup2, nil
}

// cgroup2Mount finds the root of a cgroup2 mount in /proc/self/mountinfo ("" if none).
func cgroup2Mount() (string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return "", fmt.Errorf("read mounts: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTS [OPTIONAL...] - FSTYPE SOURCE SUPEROPTS
		pre, post, ok := strings.Cut(sc.Text(), " - ")
		fields, tail := strings.Fields(pre), strings.Fields(post)
		if ok && len(fields) >= 5 && len(tail) >= 1 && tail[0] == "cgroup2" && fields[3] == "/" {
			return fields[4], nil
		}
	}
	return "", sc.Err()
}

// NetnsCookie returns the cookie of the network namespace at path: the value
// Enable takes (netnsutil.Cookie).
func NetnsCookie(path string) (uint64, error) { return netnsutil.Cookie(path) }
