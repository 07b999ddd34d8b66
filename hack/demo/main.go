// Command demo is `make demo` and `make demo-down` (the logic is pkg/demo).
//
//	demo [up] [--tag dev] [--hub meshcni.local]
//	    build the image, start the test bed (hack/testbed build + up, or use the one
//	    running), install meshcni with its Helm chart, run the demo app and print what
//	    happened; exit 1 if anything did not happen as shown. Everything stays up to
//	    be explored (eval "$(hack/testbed env)"; kubectl -n meshcni-demo get pods).
//	demo up --istio
//	    the same, then the real Istio (hack/istio up: istiod with its injector, Istio's
//	    charts) and an app in namespace istio-demo injected by istiod's webhook:
//	    prints the injected pods and a client → server connection captured by the
//	    proxies (make demo ISTIO=1; docs/istio.md).
//	demo down
//	    remove the demo app and the meshcni release, then stop the test bed
//	    (hack/testbed down).
//
// Run as root.
package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/pflag"

	"github.com/meshcni/meshcni/internal/env/demo"
	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/tools/build/image"
	"github.com/meshcni/meshcni/pkg/flagenv"
)

func main() {
	args := os.Args[1:]
	cmd := "up"
	if len(args) > 0 && (args[0] == "up" || args[0] == "down") {
		cmd, args = args[0], args[1:]
	}
	fs := pflag.NewFlagSet("demo "+cmd, pflag.ExitOnError)
	hub := fs.String("hub", image.DefaultHub, "image hub")
	withIstio := fs.Bool("istio", false, "also install the real Istio and run an app its webhook injects")
	tag := fs.String("tag", image.DefaultTag, "image tag")
	_ = fs.Parse(flagenv.GoStyle(fs, args))
	if fs.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "demo: unexpected arguments %q\n", fs.Args())
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	var err error
	switch cmd {
	case "up":
		err = up(ctx, log, *hub, *tag, *withIstio)
	case "down":
		err = down(ctx, log)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "demo %s: FAILED: %v\n", cmd, err)
		os.Exit(1)
	}
}

func root() (string, error) {
	if os.Geteuid() != 0 {
		return "", errors.New("run as root (the test bed is a real node: containerd, kubelet, network namespaces)")
	}
	return testbed.RepoRoot()
}

// hackTestbed runs hack/testbed with args, its output going to ours.
func hackTestbed(ctx context.Context, dir string, args ...string) error {
	cmd := exec.CommandContext(ctx, "bash", append([]string{filepath.Join(dir, "hack", "testbed")}, args...)...)
	cmd.Dir = dir
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("hack/testbed %v: %w", args, err)
	}
	return nil
}

func up(ctx context.Context, log *slog.Logger, hub, tag string, withIstio bool) error {
	began := time.Now()
	dir, err := root()
	if err != nil {
		return err
	}
	if err := hackTestbed(ctx, dir, "build"); err != nil {
		return err
	}
	if _, _, ok := testbed.Running(); ok {
		log.Info("demo: using the running test bed")
	} else if err := startTestbed(ctx, log, dir); err != nil {
		return err
	}
	tb, err := testbed.Attach(ctx)
	if err != nil {
		return err
	}
	_, err = demo.Run(ctx, tb, demo.Options{RepoRoot: dir, Hub: hub, Tag: tag, Out: os.Stdout, Log: log, Keep: true})
	if err == nil && withIstio {
		err = runIstio(ctx, log, tb, dir)
	}
	fmt.Printf("\ndemo took %s. Everything is still running: eval \"$(hack/testbed env)\"; kubectl -n %s get pods -o wide; make demo-down removes it.\n",
		time.Since(began).Round(time.Second), demo.Namespace)
	return err
}

// startTestbed runs `hack/testbed up`, waiting while a test holds the test bed (one
// per machine): up refuses then, so it is retried until it starts one.
func startTestbed(ctx context.Context, log *slog.Logger, dir string) error {
	logged := false
	for {
		if pid, _, busy := testbed.Busy(); busy {
			if !logged {
				log.Info("demo: waiting for the test bed's current user to finish", "pid", pid)
				logged = true
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(500 * time.Millisecond):
			}
			continue
		}
		cmd := exec.CommandContext(ctx, "bash", filepath.Join(dir, "hack", "testbed"), "up")
		cmd.Dir = dir
		out, err := cmd.CombinedOutput()
		if err == nil {
			os.Stderr.Write(out)
			return nil
		}
		if _, _, busy := testbed.Busy(); !busy {
			return fmt.Errorf("hack/testbed up: %w: %s", err, strings.TrimSpace(string(out)))
		}
		// Another user took it between our check and up's: wait again.
	}
}

func down(ctx context.Context, log *slog.Logger) error {
	dir, err := root()
	if err != nil {
		return err
	}
	if _, _, ok := testbed.Running(); ok {
		tb, err := testbed.Attach(ctx)
		if err != nil {
			return err
		}
		if err := demo.Down(ctx, tb, dir, "", 0); err != nil {
			return err
		}
		log.Info("demo: app and meshcni removed")
	}
	return hackTestbed(ctx, dir, "down")
}
