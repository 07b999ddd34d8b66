package testbed

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"time"
)

// Restart stops one component of a test bed this process owns (SIGTERM, SIGKILL
// after 10 s) and starts it again with the same command line, then waits until it
// serves again: kube-apiserver until /readyz answers, containerd until `ctr version`
// does, etcd until /health does; other components are only started. The previous
// log is kept as <name>.log.prev. Fault tests use it (the API server or containerd
// restarted under load); running pods survive a containerd restart (their shims
// keep running).
func (tb *Testbed) Restart(ctx context.Context, name string) error {
	if !tb.owned {
		return errors.New("testbed: Restart needs a test bed this process started")
	}
	i := -1
	for j, c := range tb.comps {
		if c.name == name {
			i = j
		}
	}
	if i < 0 {
		return fmt.Errorf("testbed: no component %q", name)
	}
	old := tb.comps[i]
	old.stop(10 * time.Second)
	_ = os.Rename(old.logPath, old.logPath+".prev")
	c, err := startComponent(name, old.cmd.Path, old.cmd.Args[1:]...)
	if err != nil {
		return err
	}
	tb.comps[i] = c
	if err := tb.writeState(true); err != nil {
		return err
	}
	switch name {
	case "kube-apiserver":
		return waitFor(ctx, c, "kube-apiserver ready", func() error {
			_, err := tb.Client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
			return err
		})
	case "containerd":
		return waitFor(ctx, c, "containerd", func() error {
			out, err := exec.CommandContext(ctx, "ctr", "--address", containerdSocket, "version").CombinedOutput()
			if err != nil {
				return fmt.Errorf("%w: %s", err, out)
			}
			return nil
		})
	case "etcd":
		return waitFor(ctx, c, "etcd healthy", func() error {
			return httpOK(ctx, nil, fmt.Sprintf("http://127.0.0.1:%d/health", EtcdPort))
		})
	}
	return nil
}
