package agent

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"

	"github.com/meshcni/meshcni/pkg/buildinfo"
	"github.com/meshcni/meshcni/pkg/healthz"
)

// HealthServer serves /healthz (alive), /readyz (ready: Ready returns nil, checked
// live), /metrics and /version (Build as JSON).
type HealthServer struct {
	Addr    string
	Ready   func() error
	Metrics *Metrics
	Log     *slog.Logger
	Build   buildinfo.Info
	// Detail, when set, adds lines to a ready /readyz answer (facts that do not
	// make the agent unready, such as eBPF acceleration being unavailable).
	Detail func() string

	listening chan net.Addr
}

// Name implements Runnable.
func (s *HealthServer) Name() string { return "health server" }

// Handler returns the server's routes.
func (s *HealthServer) Handler() http.Handler {
	h := healthz.Handler(nil, s.Ready, s.Metrics.Registry)
	mux := http.NewServeMux()
	mux.Handle("GET /version", s.Build.Handler())
	mux.Handle("/", h)
	if s.Detail != nil {
		mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
			if s.Ready != nil && s.Ready() != nil {
				h.ServeHTTP(w, r)
				return
			}
			fmt.Fprintf(w, "ok\n%s\n", s.Detail())
		})
	}
	return mux
}

// Run listens on Addr and serves until ctx ends.
func (s *HealthServer) Run(ctx context.Context) error {
	l, err := net.Listen("tcp", s.Addr)
	if err != nil {
		return fmt.Errorf("health server: %w", err)
	}
	if s.listening != nil {
		s.listening <- l.Addr()
	}
	s.Log.Info("serving /healthz, /readyz, /metrics and /version", "addr", l.Addr().String(), "version", s.Build.Version)
	return healthz.Serve(ctx, l, s.Handler())
}
