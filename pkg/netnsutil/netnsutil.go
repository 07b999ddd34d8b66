// Package netnsutil runs code and commands inside a network namespace given by path.
package netnsutil

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os/exec"
	"runtime"

	"golang.org/x/sys/unix"

	"github.com/containernetworking/plugins/pkg/ns"
)

// Do runs f with the calling goroutine's thread in the namespace at path ("" runs f
// in the current namespace).
func Do(path string, f func() error) error {
	if path == "" {
		return f()
	}
	return ns.WithNetNSPath(path, func(ns.NetNS) error { return f() })
}

// Exec runs a program (never a shell) inside the namespace at path, with stdin and
// extra environment, and returns its stdout. The child inherits the namespace from
// the thread that forks it. On failure the error carries stderr.
func Exec(ctx context.Context, path string, stdin io.Reader, env []string, prog string, args ...string) ([]byte, error) {
	var out []byte
	err := Do(path, func() error {
		cmd := exec.CommandContext(ctx, prog, args...)
		cmd.Stdin = stdin
		cmd.Env = env
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("%s: %w: %s", prog, err, bytes.TrimSpace(stderr.Bytes()))
		}
		out = stdout.Bytes()
		return nil
	})
	return out, err
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
