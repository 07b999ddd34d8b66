package agent

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"

	"github.com/meshcni/meshcni/pkg/healthz"
)

// HealthServer serves /healthz (alive), /readyz (ready: Ready returns nil, checked
// live) and /metrics.
type HealthServer struct {
	Addr    string
	Ready   func() error
	Metrics *Metrics
	Log     *slog.Logger

	listening chan net.Addr
}

// Name implements Runnable.
func (s *HealthServer) Name() string { return "health server" }

// Handler returns the server's routes.
func (s *HealthServer) Handler() http.Handler {
	return healthz.Handler(nil, s.Ready, s.Metrics.Registry)
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
	s.Log.Info("serving /healthz, /readyz and /metrics", "addr", l.Addr().String())
	return healthz.Serve(ctx, l, s.Handler())
}
