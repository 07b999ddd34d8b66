package netnsutil_test

import (
	"errors"
	"runtime"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/netnsutil"
)

// threadNetns identifies the calling thread's network namespace.
func threadNetns(t *testing.T) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat("/proc/thread-self/ns/net", &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

// TestDo: f runs in the namespace; the caller's thread never leaves its own,
// also when f fails or panics (the panic reaches the caller).
func TestDo(t *testing.T) {
	testutil.RequireRoot(t)
	netns := testutil.NewNetns(t)
	var st unix.Stat_t
	if err := unix.Stat(netns, &st); err != nil {
		t.Fatal(err)
	}
	target := st.Ino
	runtime.LockOSThread() // the test's own thread, whose namespace is checked
	defer runtime.UnlockOSThread()
	home := threadNetns(t)
	errBoom := errors.New("boom")
	for _, tc := range []struct {
		name  string
		f     func() error
		panic bool
		err   error
	}{
		{"returns", func() error { return nil }, false, nil},
		{"fails", func() error { return errBoom }, false, errBoom},
		{"panics", func() error { panic("boom") }, true, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var inside uint64
			var recovered any
			err := func() (err error) {
				defer func() { recovered = recover() }()
				return netnsutil.Do(netns, func() error {
					var st unix.Stat_t
					if err := unix.Stat("/proc/thread-self/ns/net", &st); err != nil {
						return err
					}
					inside = st.Ino
					return tc.f()
				})
			}()
			if inside != target {
				t.Errorf("f ran in netns %d, want %d", inside, target)
			}
			if (recovered != nil) != tc.panic || !errors.Is(err, tc.err) {
				t.Errorf("Do = %v (panic %v)", err, recovered)
			}
		})
		if got := threadNetns(t); got != home {
			t.Fatalf("after %s: the caller's thread is in netns %d, want %d", tc.name, got, home)
		}
	}
}

// TestExists: a live namespace (bind mount or /proc) is one; a plain file, a
// directory, a missing path and "" are not.
func TestExists(t *testing.T) {
	testutil.RequireRoot(t)
	netns := testutil.NewNetns(t)
	file := t.TempDir() + "/plain"
	if err := unix.Mkdir(file+"-dir", 0o755); err != nil {
		t.Fatal(err)
	}
	fd, err := unix.Open(file, unix.O_CREAT|unix.O_WRONLY, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	unix.Close(fd)
	for path, want := range map[string]bool{
		netns:                  true,
		"/proc/self/ns/net":    true,
		file:                   false,
		file + "-dir":          false,
		"/nonexistent/netns/x": false,
		"":                     false,
	} {
		if got := netnsutil.Exists(path); got != want {
			t.Errorf("Exists(%q) = %v, want %v", path, got, want)
		}
	}
}
