package taint

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Handler serves /healthz (alive; fails when leading with a Lease not renewed in
// time), /readyz (caches synced; a standby replica is ready too) and /metrics.
func (c *Controller) Handler() http.Handler {
	mux := http.NewServeMux()
	check := func(f func() error) http.HandlerFunc {
		return func(w http.ResponseWriter, _ *http.Request) {
			if err := f(); err != nil {
				http.Error(w, err.Error(), http.StatusServiceUnavailable)
				return
			}
			fmt.Fprintln(w, "ok")
		}
	}
	mux.HandleFunc("GET /healthz", check(c.Healthy))
	mux.HandleFunc("GET /readyz", check(c.Ready))
	mux.Handle("GET /metrics", promhttp.HandlerFor(c.Metrics.Registry, promhttp.HandlerOpts{Registry: c.Metrics.Registry}))
	return mux
}

// Serve listens on addr and serves Handler until ctx ends.
func (c *Controller) Serve(ctx context.Context, addr string, log *slog.Logger) error {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("health server: %w", err)
	}
	log.Info("serving /healthz, /readyz and /metrics", "addr", l.Addr().String())
	srv := &http.Server{Handler: c.Handler(), ReadHeaderTimeout: 5 * time.Second}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(l) }()
	select {
	case err := <-errc:
		return fmt.Errorf("health server: %w", err)
	case <-ctx.Done():
	}
	shut, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := srv.Shutdown(shut); err != nil {
		return fmt.Errorf("health server shutdown: %w", err)
	}
	if err := <-errc; err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
