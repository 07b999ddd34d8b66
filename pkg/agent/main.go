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
	"k8s.io/klog/v2"
)

// Main is meshcni-agent's main: it parses args and the environment, runs the agent
// until SIGTERM or SIGINT, and returns the exit code (2: bad settings, 1: failure).
func Main(args []string, getenv func(string) string, stderr io.Writer) int {
	cfg, err := ParseFlags(args, getenv, stderr)
	if errors.Is(err, pflag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintf(stderr, "meshcni-agent: %v\n", err)
		return 2
	}
	log := newLogger(stderr, cfg.LogLevel)
	opts := Options{Getenv: getenv}
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

// newLogger is the agent's JSON log on w. client-go's own logs (klog: informers,
// Events, leader election) go through it too, so the agent's log has one format.
func newLogger(w io.Writer, level slog.Level) *slog.Logger {
	log := slog.New(slog.NewJSONHandler(w, &slog.HandlerOptions{Level: level}))
	klog.SetSlogLogger(log)
	return log
}
