// Command istio drives the real Istio on the test bed (see package istio);
// hack/istio builds and runs it.
//
//	istio build   build and cache Istio (pilot-discovery, pilot-agent, istioctl,
//	              charts) and the images (idempotent)
//	istio up      install Istio's base and istiod charts and meshcni's chart on the
//	              running test bed (hack/testbed up)
//	istio down    remove meshcni and Istio from it (idempotent)
//	istio cni-up  install Istio's own istio-cni (its chart) on the running test bed
//	              (after `istio up --istio-only`: the state migration.md starts from)
//	istio cni-down  uninstall it (idempotent)
//	istio env     print shell exports: ISTIO_DIR, PATH with istioctl
package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/spf13/pflag"

	"github.com/meshcni/meshcni/internal/env/istio"
	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/testkit/reporoot"
)

const usage = "usage: istio build | up [--istio-only] [--timeout D] | down [--timeout D] | cni-up | cni-down | env"

func main() {
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	slog.SetDefault(log)
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, usage)
		os.Exit(2)
	}
	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()
	if err := run(ctx, log, os.Args[1], os.Args[2:]); err != nil {
		fmt.Fprintf(os.Stderr, "istio %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
}

func run(ctx context.Context, log *slog.Logger, cmd string, args []string) error {
	fs := pflag.NewFlagSet(cmd, pflag.ContinueOnError)
	var o istio.Options
	istioOnly := fs.Bool("istio-only", false, "up: install Istio without meshcni")
	fs.DurationVar(&o.Timeout, "timeout", 3*time.Minute, "bound on each wait")
	if err := fs.Parse(args); err != nil {
		return err
	}
	o.SkipMeshcni, o.Log = *istioOnly, log
	root, err := reporoot.Find()
	if err != nil {
		return err
	}
	o.RepoRoot = root
	switch cmd {
	case "build":
		start := time.Now()
		b, err := istio.EnsureBuilt(ctx, log)
		if err != nil {
			return err
		}
		if _, err := istio.Images(ctx, log, b); err != nil {
			return err
		}
		log.Info("istio ready to install", "version", b.Version, "release", b.Release, "dir", b.Dir, "took", time.Since(start).Round(time.Millisecond))
		return nil
	case "up", "down":
		tb, err := testbed.Attach(ctx)
		if err != nil {
			return fmt.Errorf("%w (start one with `hack/testbed up`)", err)
		}
		if cmd == "down" {
			return istio.Down(ctx, tb, o)
		}
		start := time.Now()
		inst, err := istio.Up(ctx, tb, o)
		if err != nil {
			return err
		}
		for _, s := range inst.Steps {
			fmt.Printf("%8s  %s\n", s.Took.Round(time.Millisecond), s.Name)
		}
		fmt.Printf("%8s  total\n", time.Since(start).Round(time.Millisecond))
		return nil
	case "cni-up", "cni-down":
		tb, err := testbed.Attach(ctx)
		if err != nil {
			return fmt.Errorf("%w (start one with `hack/testbed up`)", err)
		}
		if cmd == "cni-down" {
			return istio.UninstallIstioCNI(ctx, tb, o)
		}
		return istio.InstallIstioCNI(ctx, tb, o)
	case "env":
		b, err := istio.Lookup(ctx)
		if err != nil {
			return err
		}
		fmt.Printf("export ISTIO_DIR=%s\nexport ISTIO_VERSION=%s\nexport PATH=%s:$PATH\n", b.Dir, b.Version, filepath.Dir(b.Bin("istioctl")))
		return nil
	default:
		return errors.New(usage)
	}
}
