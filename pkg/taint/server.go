package taint

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"

	"github.com/meshcni/meshcni/pkg/healthz"
)

// Handler serves /healthz (alive; fails when leading with a Lease not renewed in
// time), /readyz (caches synced; a standby replica is ready too) and /metrics. An open
// breaker leaves /readyz at 200 (the controller still removes taints, and a Service
// that scrapes Ready pods keeps reporting meshcni_taint_breaker_open) and adds a line
// that says so.
func (c *Controller) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/", healthz.Handler(c.Healthy, c.Ready, c.Metrics.Registry))
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if err := c.Ready(); err != nil {
			http.Error(w, "not ready: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
		if s := c.Breaker(); s.Open {
			fmt.Fprintln(w, s.String())
		}
	})
	return mux
}

// Serve listens on addr and serves Handler until ctx ends.
func (c *Controller) Serve(ctx context.Context, addr string, log *slog.Logger) error {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("health server: %w", err)
	}
	log.Info("serving /healthz, /readyz and /metrics", "addr", l.Addr().String())
	return healthz.Serve(ctx, l, c.Handler())
}
