package agentsock

import (
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
)

const nobody = 65534

// listenAt is a bare listener on the agent socket path of dir (who listens is what
// the test is about, not what it answers).
func listenAt(t *testing.T, dir string) {
	t.Helper()
	l, err := net.Listen("unix", Path(dir))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
}

// TestDialRefusesUntrustedDirectory: a run directory anyone could have put the socket
// in is refused before connecting.
func TestDialRefusesUntrustedDirectory(t *testing.T) {
	testutil.RequireRoot(t)
	for _, tc := range []struct {
		name  string
		setup func(dir string) error
		want  string
	}{
		{"world-writable", func(dir string) error { return os.Chmod(dir, 0o777) }, "writable by group or others"},
		{"group-writable", func(dir string) error { return os.Chmod(dir, 0o775) }, "writable by group or others"},
		{"owned by nobody", func(dir string) error { return os.Chown(dir, nobody, nobody) }, "owned by uid 65534"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			listenAt(t, dir)
			if _, err := Dial(dir); err != nil {
				t.Fatalf("trusted directory: %v", err)
			}
			if err := tc.setup(dir); err != nil {
				t.Fatal(err)
			}
			c, err := Dial(dir)
			if !errors.Is(err, ErrUntrusted) || !strings.Contains(err.Error(), tc.want) {
				c.Close()
				t.Fatalf("Dial = %v, want ErrUntrusted containing %q", err, tc.want)
			}
		})
	}
	// A symlinked run directory is not followed.
	dir := t.TempDir()
	listenAt(t, dir)
	link := filepath.Join(t.TempDir(), "run")
	if err := os.Symlink(dir, link); err != nil {
		t.Fatal(err)
	}
	if _, err := Dial(link); !errors.Is(err, ErrUntrusted) || !strings.Contains(err.Error(), "not a directory") {
		t.Errorf("Dial through a symlink = %v, want ErrUntrusted", err)
	}
}

// TestDialRefusesNonRootPeer: a socket in a proper directory, but listened on by a
// process that is not root (it bound elsewhere and the socket was moved in), is
// refused after connecting (SO_PEERCRED).
func TestDialRefusesNonRootPeer(t *testing.T) {
	testutil.RequireRoot(t)
	if os.Getenv("MESHCNI_TEST_LISTEN_AS_NOBODY") != "" {
		t.Skip("the helper process runs TestHelperListen only")
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	// The test binary, where nobody can run it.
	bin := filepath.Join(t.TempDir(), "agentsock.test")
	data, err := os.ReadFile(exe)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, data, 0o755); err != nil {
		t.Fatal(err)
	}
	for d := filepath.Dir(bin); d != "/"; d = filepath.Dir(d) {
		if d == os.TempDir() {
			break
		}
		_ = os.Chmod(d, 0o755)
	}
	nobodyDir := t.TempDir()
	if err := os.Chown(nobodyDir, nobody, nobody); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(nobodyDir, "s")
	cmd := exec.Command(bin, "-test.run=^TestHelperListen$")
	cmd.Env = append(os.Environ(), "MESHCNI_TEST_LISTEN_AS_NOBODY="+sock)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: nobody}}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	for i := 0; ; i++ { // wait for the socket, bounded
		if _, err := os.Stat(sock); err == nil {
			break
		}
		if i == 400 {
			t.Fatal("the helper process did not listen")
		}
		time.Sleep(25 * time.Millisecond)
	}
	runDir := t.TempDir() // root's, 0700
	if err := os.Rename(sock, Path(runDir)); err != nil {
		t.Fatal(err)
	}
	c, err := Dial(runDir)
	if !errors.Is(err, ErrUntrusted) || !strings.Contains(err.Error(), "uid 65534") {
		c.Close()
		t.Fatalf("Dial = %v, want ErrUntrusted naming uid 65534", err)
	}
}

// TestHelperListen is the helper process of TestDialRefusesNonRootPeer: it listens
// as nobody until killed.
func TestHelperListen(t *testing.T) {
	sock := os.Getenv("MESHCNI_TEST_LISTEN_AS_NOBODY")
	if sock == "" {
		t.Skip("helper process only")
	}
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		c.Close()
	}
}

// TestListenSecuresDirectory: the agent takes back a run directory someone made
// writable or owns, so its own plugin trusts it again.
func TestListenSecuresDirectory(t *testing.T) {
	testutil.RequireRoot(t)
	dir := t.TempDir()
	if err := os.Chmod(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(dir, nobody, nobody); err != nil {
		t.Fatal(err)
	}
	l, err := Listen(Path(dir))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	fi, err := os.Stat(dir)
	if err != nil {
		t.Fatal(err)
	}
	st := fi.Sys().(*syscall.Stat_t)
	if fi.Mode().Perm() != 0o755 || st.Uid != 0 || st.Gid != 0 {
		t.Errorf("directory mode %o owner %d:%d, want 755 0:0", fi.Mode().Perm(), st.Uid, st.Gid)
	}
	c, err := Dial(dir)
	if err != nil {
		t.Fatalf("Dial after Listen: %v", err)
	}
	c.Close()
}

// TestReleaseBoundTotal: across connections the agent holds at most MaxHeld released
// descriptors (512 connections × 64 each ran the agent out of descriptors); the rest
// are closed as they arrive, and a connection's end gives its share back.
func TestReleaseBoundTotal(t *testing.T) {
	dir, got, _, _ := startServerWith(t, nil, -1, func(s *Server) { s.MaxHeld = 10 })
	var clients []*Client
	var reads [][]int
	for range 2 {
		c, err := Dial(dir)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		rs, ws := pipes(t, 8)
		if err := c.Release(ws...); err != nil {
			t.Fatal(err)
		}
		for _, fd := range ws {
			unix.Close(fd)
		}
		if err := c.ReportCommand(CommandAdd, ResultSuccess, time.Millisecond, Pod{Namespace: "ns", Name: "p"}, nil); err != nil {
			t.Fatal(err)
		}
		recv(t, got.cmds) // its release was read
		clients, reads = append(clients, c), append(reads, rs)
	}
	held := 0
	for _, rs := range reads {
		for _, hup := range hungUp(t, rs, 0) {
			if !hup {
				held++
			}
		}
	}
	if held != 10 {
		t.Fatalf("%d descriptors held across two connections, want the bound 10", held)
	}
	// The first connection ends: its 8 are closed, and 8 more can be held.
	clients[0].Close()
	for i, hup := range hungUp(t, reads[0], 5*time.Second) {
		if !hup {
			t.Fatalf("pipe %d of the ended connection still held", i)
		}
	}
	rs, ws := pipes(t, 8)
	if err := clients[1].Release(ws...); err != nil {
		t.Fatal(err)
	}
	for _, fd := range ws {
		unix.Close(fd)
	}
	if err := clients[1].ReportCommand(CommandAdd, ResultSuccess, time.Millisecond, Pod{Namespace: "ns", Name: "p"}, nil); err != nil {
		t.Fatal(err)
	}
	recv(t, got.cmds)
	for i, hup := range hungUp(t, rs, 0) {
		if hup {
			t.Fatalf("pipe %d closed at once, want it held (the bound has room again)", i)
		}
	}
}
