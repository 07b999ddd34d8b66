package agent

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"

	"github.com/meshcni/meshcni/pkg/agentsock"
)

// SocketServer receives the plugin's log records and command results on the agent
// socket: records are logged with the pod's name and namespace, results feed metrics.
// It answers the plugin's pod lookups (agentsock.RequestPod) from Pods, the node's
// pod cache (nil: every lookup is a miss and the plugin asks the API server), and
// closes the descriptors the plugin hands over (agentsock.KindRelease).
type SocketServer struct {
	Path    string
	Log     *slog.Logger
	Metrics *Metrics
	Pods    PodSource
}

// Name implements Runnable.
func (s *SocketServer) Name() string { return "plugin socket" }

// Run serves the socket until ctx ends.
func (s *SocketServer) Run(ctx context.Context) error {
	plog := s.Log.With("source", "plugin")
	srv := &agentsock.Server{
		Path:   s.Path,
		Logger: s.Log,
		OnLog: func(r *agentsock.LogRecord) {
			var level slog.Level
			if err := level.UnmarshalText([]byte(r.Level)); err != nil {
				level = slog.LevelInfo
			}
			attrs := make([]slog.Attr, 0, len(r.Attrs)+3)
			attrs = append(attrs,
				slog.String("pod_namespace", r.Pod.Namespace),
				slog.String("pod_name", r.Pod.Name),
				slog.Time("plugin_time", r.Time))
			for k, v := range r.Attrs {
				attrs = append(attrs, slog.Any(k, v))
			}
			plog.LogAttrs(ctx, level, r.Msg, attrs...)
		},
		OnCommand: func(r *agentsock.CommandResult) {
			s.Metrics.ObserveCommand(r)
			args := []any{"command", r.Command, "result", r.Result, "duration_seconds", r.Seconds,
				"pod_namespace", r.Pod.Namespace, "pod_name", r.Pod.Name}
			if r.ErrorMsg != "" {
				args = append(args, "err", r.ErrorMsg)
			}
			plog.Debug("CNI command", args...)
		},
	}
	srv.OnRequest = func(_ context.Context, req *agentsock.Request) (json.RawMessage, error) {
		if req.Type != agentsock.RequestPod {
			return nil, agentsock.ErrUnsupported
		}
		var pr agentsock.PodRequest
		if err := json.Unmarshal(req.Body, &pr); err != nil {
			return nil, fmt.Errorf("pod request: %w", err)
		}
		resp, err := AnswerPod(s.Pods, pr)
		if err != nil {
			return nil, err
		}
		if !resp.Found {
			plog.Debug("pod lookup: miss", "pod_namespace", pr.Namespace, "pod_name", pr.Name, "reason", resp.Reason)
		}
		return json.Marshal(resp)
	}
	s.Log.Info("plugin socket listening", "path", s.Path)
	return srv.Serve(ctx)
}
