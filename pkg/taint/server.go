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
// time), /readyz (caches synced; a standby replica is ready too) and /metrics.
func (c *Controller) Handler() http.Handler {
	return healthz.Handler(c.Healthy, c.Ready, c.Metrics.Registry)
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
