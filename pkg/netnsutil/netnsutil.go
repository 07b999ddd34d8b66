// Package netnsutil is meshcni's one way into a network namespace given by path:
// Do runs code there, Exec a program, Open hands a library the namespace's file
// descriptor (google/nftables' WithNetNSFd, a veth's peer namespace), InScratch
// runs code in a new, empty namespace.
package netnsutil

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"runtime"

	"golang.org/x/sys/unix"
)

// Do runs f on a thread in the namespace at path ("": f runs on the calling
// goroutine, in its thread's current namespace). f runs on a goroutine of its own,
// locked to its thread, which moves the thread back and unlocks it when f returns
// or panics; the caller's thread never moves. If the move back fails (it cannot,
// short of the kernel refusing to return to a namespace the thread just left), the
// goroutine exits still locked, so the runtime ends the thread and no goroutine
// ever runs in the pod's namespace by mistake: the agent, a long-lived process,
// probes through here. A panic in f is raised again in the caller.
func Do(path string, f func() error) error {
	if path == "" {
		return f()
	}
	fd, err := Open(path)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	type result struct {
		err      error
		panicked bool
		p        any
	}
	done := make(chan result, 1)
	go func() {
		var res result
		defer func() { done <- res }()
		runtime.LockOSThread()
		orig, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			runtime.UnlockOSThread()
			res.err = fmt.Errorf("open the thread's netns: %w", err)
			return
		}
		defer unix.Close(orig)
		if err := unix.Setns(fd, unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread() // a failed setns leaves the thread where it was
			res.err = fmt.Errorf("enter netns %s: %w", path, err)
			return
		}
		defer func() {
			if p := recover(); p != nil {
				res.panicked, res.p = true, p
			}
			if err := unix.Setns(orig, unix.CLONE_NEWNET); err != nil {
				// Still locked: the thread ends with the goroutine.
				res.err = errors.Join(res.err, fmt.Errorf("leave netns %s (its thread is discarded): %w", path, err))
				return
			}
			runtime.UnlockOSThread()
		}()
		res.err = f()
	}()
	res := <-done
	if res.panicked {
		panic(res.p)
	}
	return res.err
}

// Open opens the namespace at path and returns its file descriptor (close-on-exec),
// for libraries that enter a namespace themselves given its descriptor. The caller
// closes it.
func Open(path string) (int, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("open netns %s: %w", path, err)
	}
	return fd, nil
}

// Exists reports whether path is a live network namespace: a file of the namespace
// filesystem (a bind mount under /run/netns or a runtime's state dir) or of /proc
// (/proc/PID/ns/net) that can be opened.
func Exists(path string) bool {
	if path == "" {
		return false
	}
	fd, err := Open(path)
	if err != nil {
		return false
	}
	defer unix.Close(fd)
	var st unix.Statfs_t
	if err := unix.Fstatfs(fd, &st); err != nil {
		return false
	}
	return st.Type == unix.NSFS_MAGIC || st.Type == unix.PROC_SUPER_MAGIC
}

// ErrOutputLimit is wrapped by Exec's error when the program wrote more than the
// limit to its standard output: it was killed and nothing it printed is returned.
var ErrOutputLimit = errors.New("output limit exceeded")

// MaxStderr is how much of a program's standard error Exec keeps for its error; the
// rest is read and dropped, so a noisy program neither blocks nor fills memory.
const MaxStderr = 64 << 10

// Exec runs a program (never a shell) inside the namespace at path, with stdin and
// extra environment, and returns its stdout. The child inherits the namespace from
// the thread that forks it. On failure the error carries stderr (its first
// MaxStderr bytes). Standard output is read up to limit bytes: past it the program
// is killed and the error wraps ErrOutputLimit.
func Exec(ctx context.Context, path string, stdin io.Reader, env []string, limit int, prog string, args ...string) ([]byte, error) {
	var out []byte
	err := Do(path, func() error {
		ctx, cancel := context.WithCancel(ctx)
		defer cancel()
		cmd := exec.CommandContext(ctx, prog, args...) // cancel kills it (SIGKILL)
		cmd.Stdin = stdin
		cmd.Env = env
		stdout := &capped{limit: limit, over: cancel}
		stderr := &capped{limit: MaxStderr}
		cmd.Stdout, cmd.Stderr = stdout, stderr
		err := cmd.Run()
		if stdout.exceeded {
			return fmt.Errorf("%s: %w: more than %d bytes on standard output, killed", prog, ErrOutputLimit, limit)
		}
		if err != nil {
			return fmt.Errorf("%s: %w: %s", prog, err, bytes.TrimSpace(stderr.buf.Bytes()))
		}
		out = stdout.buf.Bytes()
		return nil
	})
	return out, err
}

// capped keeps up to limit bytes. With over set, a write past the limit calls over
// and fails (the copy from the program stops); without, the rest is dropped.
type capped struct {
	buf      bytes.Buffer
	limit    int
	over     func()
	exceeded bool
}

func (c *capped) Write(p []byte) (int, error) {
	room := c.limit - c.buf.Len()
	if len(p) <= room {
		return c.buf.Write(p)
	}
	if c.over == nil {
		c.buf.Write(p[:max(room, 0)])
		return len(p), nil
	}
	c.exceeded = true
	c.over()
	return 0, ErrOutputLimit
}

// InScratch runs f on a thread moved into a new, empty network namespace that
// disappears when f returns. Inside f, Exec and Do with path "" act on it.
func InScratch(f func() error) error {
	errc := make(chan error, 1)
	go func() {
		// The thread is never unlocked: it exits with the goroutine, taking the
		// scratch namespace with it, and no other goroutine ever runs in it.
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("unshare scratch netns: %w", err)
			return
		}
		errc <- f()
	}()
	return <-errc
}
