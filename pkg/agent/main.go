package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os/signal"
	"syscall"

	"github.com/spf13/pflag"

	"github.com/meshcni/meshcni/pkg/logformat"
)

// Main is meshcni-agent's main: it parses args and the environment, runs the agent
// until SIGTERM or SIGINT, and returns the exit code (2: bad settings, 1: failure).
// It is MainVersion of a build without a version ("dev").
func Main(args []string, getenv func(string) string, stderr io.Writer) int {
	return MainVersion("", args, getenv, stderr)
}

// MainVersion is Main for the binary's version (its main.version), served on
// /version and in meshcni_build_info.
func MainVersion(version string, args []string, getenv func(string) string, stderr io.Writer) int {
	cfg, err := ParseFlags(args, getenv, stderr)
	if errors.Is(err, pflag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintf(stderr, "meshcni-agent: %v\n", err)
		return 2
	}
	log := newLogger(stderr, cfg.LogLevel, cfg.LogFormat)
	opts := Options{Getenv: getenv, Version: version}
	if k, err := NewKube(cfg); err == nil {
		defer k.Stop()
		opts.Kube = k
	} else {
		log.Info("no Kubernetes API access: Events and the node's pods are off", "reason", err.Error())
	}
	if rec, err := NewPodRecorder(cfg, opts.Kube); err == nil {
		opts.Recorder = rec
	} else {
		log.Info("Kubernetes Events about the agent disabled", "reason", err.Error())
	}
	a, err := New(cfg, log, opts)
	if err != nil {
		log.Error("cannot start", "err", err)
		return 2
	}
	if err := a.AddRepair(opts.Kube); err != nil {
		log.Error("cannot start", "err", err)
		return 2
	}
	if err := a.AddAudit(opts.Kube); err != nil {
		log.Error("cannot start", "err", err)
		return 2
	}
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer cancel()
	if err := a.Run(ctx); err != nil {
		log.Error("agent stopped", "err", err)
		return 1
	}
	return 0
}

// newLogger is the agent's log on w, JSON or text (--log-format). client-go's own logs
// (klog: informers, Events, leader election) go through it too, so the agent's log has
// one format.
func newLogger(w io.Writer, level slog.Level, format string) *slog.Logger {
	return logformat.New(w, level, format)
}
