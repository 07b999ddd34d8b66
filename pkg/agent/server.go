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

	listening chan net.Addr
}

// Name implements Runnable.
func (s *HealthServer) Name() string { return "health server" }

// Handler returns the server's routes.
func (s *HealthServer) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /version", s.Build.Handler())
	mux.Handle("/", healthz.Handler(nil, s.Ready, s.Metrics.Registry))
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
