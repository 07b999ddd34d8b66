// Package healthz is the health and metrics endpoint of meshcni's long-running
// commands (the agent, the taint controller): /healthz, /readyz and /metrics on one
// listener, served until a context ends.
package healthz

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Handler serves GET /healthz (200 when alive returns nil; nil alive: always),
// /readyz (200 when ready returns nil, else 503 with the reason) and /metrics (reg).
func Handler(alive, ready func() error, reg *prometheus.Registry) http.Handler {
	check := func(what string, f func() error) http.HandlerFunc {
		return func(w http.ResponseWriter, _ *http.Request) {
			if f != nil {
				if err := f(); err != nil {
					http.Error(w, what+": "+err.Error(), http.StatusServiceUnavailable)
					return
				}
			}
			fmt.Fprintln(w, "ok")
		}
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", check("unhealthy", alive))
	mux.HandleFunc("GET /readyz", check("not ready", ready))
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	return mux
}

// Serve serves h on l until ctx ends, then shuts down, giving requests in flight
// two seconds. An error of the listener ends it early.
func Serve(ctx context.Context, l net.Listener, h http.Handler) error {
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
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
