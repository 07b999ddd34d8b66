package sockmap_test

import (
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/ebpf/sockmap"
)

// TestPinDirNotOnBPFFS: a pin directory whose filesystem is not a bpffs makes the
// acceleration unavailable with that reason, and nothing is mounted or created —
// also with MountBPFFS when the directory is not under /sys/fs/bpf.
func TestPinDirNotOnBPFFS(t *testing.T) {
	testutil.RequireRoot(t)
	base := t.TempDir()
	for _, mount := range []bool{false, true} {
		opts := sockmap.Options{PinDir: filepath.Join(base, "meshcni", "sockmap"), MountBPFFS: mount}
		for name, f := range map[string]func() error{
			"Detect": func() error { _, err := sockmap.Detect(opts); return err },
			"Load":   func() error { a, err := sockmap.Load(opts); closeAccel(a); return err },
		} {
			err := f()
			if !errors.Is(err, sockmap.ErrUnavailable) || !strings.Contains(err.Error(), "is not on a bpffs") {
				t.Errorf("%s (MountBPFFS %v): want ErrUnavailable saying the pin directory is not on a bpffs, got %v", name, mount, err)
			}
		}
		if _, err := os.Stat(filepath.Join(base, "meshcni")); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("MountBPFFS %v: %s/meshcni made by a refused Load (stat: %v)", mount, base, err)
		}
		if fs := statfs(t, base); fs == unix.BPF_FS_MAGIC {
			t.Errorf("MountBPFFS %v: a bpffs was mounted at %s", mount, base)
		}
	}
}

// TestDefaultPinDirWithoutBPFFS: in a mount namespace of the test's own where
// /sys/fs/bpf is not a bpffs (a tmpfs over it, as a container sees an empty
// directory), the default pin directory is refused unless MountBPFFS is set (a
// host-process agent), which mounts a bpffs there — only in that namespace.
func TestDefaultPinDirWithoutBPFFS(t *testing.T) {
	testutil.RequireRoot(t)
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread, in its own mount namespace, exits with the goroutine
		errc <- func() error {
			if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
				return err
			}
			if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
				return err
			}
			if err := unix.Mount("tmpfs", sockmap.DefaultBPFFS, "tmpfs", 0, "size=1m"); err != nil {
				return err
			}
			_, err := sockmap.Detect(sockmap.Options{})
			if !errors.Is(err, sockmap.ErrUnavailable) || !strings.Contains(err.Error(), "is not on a bpffs") || !strings.Contains(err.Error(), "mount -t bpf") {
				return errors.New("without MountBPFFS: want ErrUnavailable saying /sys/fs/bpf is not a bpffs and how to mount one, got " + errString(err))
			}
			var st unix.Statfs_t
			if err := unix.Statfs(sockmap.DefaultBPFFS, &st); err != nil || st.Type != unix.TMPFS_MAGIC {
				return errors.New("without MountBPFFS: something was mounted over the tmpfs")
			}
			if _, err := sockmap.Detect(sockmap.Options{MountBPFFS: true}); err != nil {
				if errors.Is(err, sockmap.ErrUnavailable) && !strings.Contains(err.Error(), "bpffs") {
					return errSkip{err}
				}
				return errors.New("with MountBPFFS: " + err.Error())
			}
			if err := unix.Statfs(sockmap.DefaultBPFFS, &st); err != nil || st.Type != unix.BPF_FS_MAGIC {
				return errors.New("with MountBPFFS: no bpffs at /sys/fs/bpf afterwards")
			}
			return nil
		}()
	}()
	err := <-errc
	var skip errSkip
	if errors.As(err, &skip) {
		testutil.Missing(t, "%v", skip.error)
	}
	if err != nil {
		t.Fatal(err)
	}
}

type errSkip struct{ error }

func errString(err error) string {
	if err == nil {
		return "nil"
	}
	return err.Error()
}

func closeAccel(a *sockmap.Accel) {
	if a != nil {
		a.Close()
	}
}

func statfs(t *testing.T, dir string) int64 {
	t.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		t.Fatal(err)
	}
	return int64(st.Type)
}
