// Command envoy is the Envoy stand-in of the Istio test images (see
// internal/standin/proxysim, envoy.go): pilot-agent starts it as /usr/local/bin/envoy with
// Envoy's command line. It writes one JSON line per proxysim record to stdout and
// logs JSON to stderr; pilot-agent passes both to the istio-proxy container's log.
//
// Build it static: CGO_ENABLED=0 go build ./hack/envoy
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"sync"
	"syscall"

	"github.com/meshcni/meshcni/internal/standin/proxysim"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:]); err != nil {
		fmt.Fprintf(os.Stderr, "envoy (meshcni stand-in): %v\n", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, argv []string) error {
	args, err := proxysim.ParseEnvoyArgs(argv)
	if err != nil {
		return err
	}
	log := slog.New(slog.NewJSONHandler(os.Stderr, nil)).With("component", "envoy-standin")
	var mu sync.Mutex
	enc := json.NewEncoder(os.Stdout)
	dual, _ := strconv.ParseBool(os.Getenv("ISTIO_DUAL_STACK"))
	// istiod makes Envoy's inbound listener transparent for a proxy whose node
	// metadata says INTERCEPTION_MODE TPROXY; pilot-agent takes it from this variable.
	tproxy := os.Getenv("ISTIO_META_INTERCEPTION_MODE") == "TPROXY"
	e, err := proxysim.NewEnvoy(proxysim.EnvoyConfig{
		Args: args, DualStack: dual, TPROXY: tproxy, Logger: log,
		OnRecord: func(r proxysim.Record) {
			mu.Lock()
			defer mu.Unlock()
			_ = enc.Encode(r)
		},
	})
	if err != nil {
		return err
	}
	return e.Run(ctx)
}
