package sockmap

import (
	"bytes"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf/btf"
	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
)

// TestProgramsAssemble: both programs assemble (labels resolve, every map
// reference names a map of the spec).
func TestProgramsAssemble(t *testing.T) {
	cs := spec(0)
	for name, p := range cs.Programs {
		var buf bytes.Buffer
		if err := p.Instructions.Marshal(&buf, binary.LittleEndian); err != nil {
			t.Errorf("%s: %v", name, err)
		}
		for _, ins := range p.Instructions {
			if ref := ins.Reference(); ref != "" && ins.IsLoadFromMap() {
				if _, ok := cs.Maps[ref]; !ok {
					t.Errorf("%s: reference to unknown map %q", name, ref)
				}
			}
		}
	}
}

// TestContextOffsets checks the UAPI offsets the programs read against the
// running kernel's BTF (struct bpf_sock_ops, struct sk_msg_md).
func TestContextOffsets(t *testing.T) {
	if _, err := os.Stat("/sys/kernel/btf/vmlinux"); err != nil {
		testutil.Missing(t, "kernel BTF: %v", err)
	}
	kspec, err := btf.LoadKernelSpec()
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		typ, member string
		want        int
	}{
		{"bpf_sock_ops", "op", opsOp},
		{"bpf_sock_ops", "family", opsFamily},
		{"bpf_sock_ops", "remote_ip4", opsRemote4},
		{"bpf_sock_ops", "local_ip4", opsLocal4},
		{"bpf_sock_ops", "remote_ip6", opsRemote6},
		{"bpf_sock_ops", "local_ip6", opsLocal6},
		{"bpf_sock_ops", "rcv_nxt", opsRcvNxt},
		{"bpf_sock_ops", "snd_nxt", opsSndNxt},
		{"bpf_sock_ops", "sk", opsSk},
		{"sk_msg_md", "size", msgSize},
		{"sk_msg_md", "sk", msgSk},
	} {
		var s *btf.Struct
		if err := kspec.TypeByName(c.typ, &s); err != nil {
			t.Fatalf("%s: %v", c.typ, err)
		}
		off, ok := memberOffset(s.Members, c.member)
		if !ok || int(off) != c.want {
			t.Errorf("%s.%s at %d (found %v), the program reads %d", c.typ, c.member, off, ok, c.want)
		}
	}
	if off, err := skUIDOffset(); err != nil || off <= 0 {
		t.Errorf("sk_uid offset %d: %v", off, err)
	}
}

// TestForced: the forced setting fails Detect before touching the kernel.
func TestForced(t *testing.T) {
	_, err := Detect(Options{ForceUnavailable: "off in this cluster"})
	if !errors.Is(err, ErrUnavailable) || err.Error() != "eBPF acceleration unavailable: forced by setting: off in this cluster" {
		t.Errorf("got %v", err)
	}
}

// TestCgroup2Setting: a Cgroup2 setting that is not a cgroup2 directory is
// refused by name.
func TestCgroup2Setting(t *testing.T) {
	dir := t.TempDir()
	_, err := cgroup2Dir(Options{Cgroup2: dir})
	if err == nil || err.Error() != dir+" is not a cgroup2 directory, nor is its unified/" {
		t.Errorf("got %v", err)
	}
}

// TestCgroup2Hybrid: a Cgroup2 setting naming a cgroup v1 hybrid host's
// /sys/fs/cgroup (a tmpfs with cgroup2 at unified/, as the chart mounts the node's
// /sys/fs/cgroup by default) resolves to its unified/ directory; a cgroup2
// directory itself is taken as it is.
func TestCgroup2Hybrid(t *testing.T) {
	testutil.RequireRoot(t)
	root := t.TempDir()
	if err := unix.Mount("tmpfs", root, "tmpfs", 0, ""); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = unix.Unmount(root, unix.MNT_DETACH) }()
	unified := filepath.Join(root, "unified")
	if err := os.Mkdir(unified, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("cgroup2", unified, "cgroup2", 0, ""); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = unix.Unmount(unified, unix.MNT_DETACH) }()
	for _, setting := range []string{root, unified} {
		if got, err := cgroup2Dir(Options{Cgroup2: setting}); err != nil || got != unified {
			t.Errorf("cgroup2Dir(%s) = %q, %v; want %s", setting, got, err, unified)
		}
	}
}
