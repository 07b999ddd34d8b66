package traffic

import (
	"bytes"
	"errors"
	"fmt"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/netnsutil"
)

// ProxyUID is Istio's proxy UID and GID (istio-proxy, 1337).
const ProxyUID = 1337

// Cred is the identity a child process runs as.
type Cred struct {
	UID, GID uint32
	// NetAdmin raises CAP_NET_ADMIN as an ambient capability (IP_TRANSPARENT).
	NetAdmin bool
}

// ProxyCred is UID/GID 1337.
var ProxyCred = Cred{UID: ProxyUID, GID: ProxyUID}

// Root is UID/GID 0.
var Root = Cred{}

// StartInNetns starts cmd inside the network namespace at nsPath as cred and returns a
// channel that receives cmd.Wait's result. cmd.SysProcAttr is replaced. The starting
// thread is locked, moved into the namespace and never returned to the scheduler.
func StartInNetns(nsPath string, cred Cred, cmd *exec.Cmd) (<-chan error, error) {
	attr := &syscall.SysProcAttr{
		Credential: &syscall.Credential{Uid: cred.UID, Gid: cred.GID, Groups: []uint32{}},
		Pdeathsig:  syscall.SIGKILL,
		Setpgid:    true,
	}
	if cred.NetAdmin {
		attr.AmbientCaps = []uintptr{unix.CAP_NET_ADMIN}
	}
	cmd.SysProcAttr = attr
	if cmd.Dir == "" {
		cmd.Dir = "/"
	}
	started := make(chan error, 1)
	done := make(chan error, 1)
	go func() {
		// The child is started and waited for on Do's thread in the namespace: that
		// thread anchors Pdeathsig, it lives until the child has been waited for.
		err := netnsutil.Do(nsPath, func() error {
			if err := cmd.Start(); err != nil {
				return fmt.Errorf("start %s: %w", cmd.Path, err)
			}
			started <- nil
			done <- cmd.Wait()
			return nil
		})
		if err != nil {
			started <- err
		}
	}()
	if err := <-started; err != nil {
		return nil, err
	}
	return done, nil
}

// RunInNetns runs a program to completion inside the namespace as cred, bounded by
// timeout (the child is killed when it expires), and returns its stdout. The error
// includes stderr.
func RunInNetns(nsPath string, cred Cred, timeout time.Duration, bin string, args ...string) ([]byte, error) {
	return RunCmdInNetns(nsPath, cred, timeout, exec.Command(bin, args...))
}

// RunCmdInNetns is RunInNetns for a prepared command (set Env, Dir, Stdin on it);
// Stdout and Stderr are captured here.
func RunCmdInNetns(nsPath string, cred Cred, timeout time.Duration, cmd *exec.Cmd) ([]byte, error) {
	var stdout, stderr bytes.Buffer
	bin, args := cmd.Path, cmd.Args[1:]
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	done, err := StartInNetns(nsPath, cred, cmd)
	if err != nil {
		return nil, err
	}
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case err = <-done:
	case <-timer.C:
		_ = cmd.Process.Kill()
		<-done
		return stdout.Bytes(), fmt.Errorf("%s %q: killed after %v: stderr: %s", bin, args, timeout, stderr.Bytes())
	}
	if err != nil {
		return stdout.Bytes(), fmt.Errorf("%s %q: %w: stderr: %s", bin, args, err, stderr.Bytes())
	}
	return stdout.Bytes(), nil
}

// ExitCode returns the exit code carried by an error from RunInNetns (-1 if none).
func ExitCode(err error) int {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode()
	}
	if err == nil {
		return 0
	}
	return -1
}

// MustRun runs a program as root inside the namespace (e.g. a test's hand-written
// iptables-nft rule) and fails the test on error.
func MustRun(t testing.TB, nsPath, bin string, args ...string) []byte {
	t.Helper()
	out, err := RunInNetns(nsPath, Root, 30*time.Second, bin, args...)
	if err != nil {
		t.Fatalf("in %s: %v", nsPath, err)
	}
	return out
}

// Iptables runs iptables-nft (or ip6tables-nft when v6) as root in the namespace; for
// tests' own hand-written rules.
func Iptables(t testing.TB, nsPath string, v6 bool, args ...string) {
	t.Helper()
	name := "iptables-nft"
	if v6 {
		name = "ip6tables-nft"
	}
	bin := testutil.RequireBinary(t, name)
	MustRun(t, nsPath, bin, args...)
}

// InNetns runs fn on a thread inside the namespace (for in-process sockets).
func InNetns(nsPath string, fn func() error) error {
	return netnsutil.Do(nsPath, fn)
}
