package agent

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"maps"
	"slices"

	"github.com/meshcni/meshcni/pkg/agentsock"
)

// SocketServer receives the plugin's log records and command results on the agent
// socket: records are logged with the pod's name and namespace, results feed metrics.
// It answers the plugin's pod lookups (agentsock.RequestPod) from Pods, the node's
// pod cache (nil: every lookup is a miss and the plugin asks the API server), and
// closes the descriptors the plugin hands over (agentsock.KindRelease). OnResult sees
// each command result (the redirected marker).
type SocketServer struct {
	Path    string
	Log     *slog.Logger
	Metrics *Metrics
	Pods    PodSource
	// OnResult, when set, gets every command result after the metrics (Marker.Observe);
	// it must not block.
	OnResult func(*agentsock.CommandResult)
	EBPF     *EBPF // enables the eBPF acceleration of the pods the plugin reports (nil: none)
	// Sandboxes records what each sandbox's ADD taught the agent (nil: nothing).
	Sandboxes *Sandboxes
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
			plog.LogAttrs(ctx, level, r.Msg, pluginLogAttrs(r)...)
		},
		OnCommand: func(r *agentsock.CommandResult) {
			s.Metrics.ObserveCommand(r)
			if s.OnResult != nil {
				s.OnResult(r)
			}
			s.EBPF.OnCommand(r)
			if s.Sandboxes != nil {
				s.Sandboxes.OnCommand(r) // after EBPF, which reads the sandbox's cookie
			}
			args := []any{"command", r.Command, "result", r.Result, "duration_seconds", r.Seconds,
				"pod_namespace", r.Pod.Namespace, "pod_name", r.Pod.Name}
			if r.ErrorMsg != "" {
				args = append(args, "err", r.ErrorMsg)
			}
			plog.Debug("CNI command", args...)
		},
	}
	srv.OnRequest = func(_ context.Context, req *agentsock.Request) (json.RawMessage, error) {
		if req.Type == agentsock.RequestEBPF {
			var er agentsock.EBPFRequest
			if err := json.Unmarshal(req.Body, &er); err != nil {
				return nil, fmt.Errorf("eBPF request: %w", err)
			}
			resp, err := s.EBPF.Answer(er)
			if err != nil {
				return nil, err
			}
			return json.Marshal(resp)
		}
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

// MaxPluginAttrs bounds the attributes of one plugin log record the agent logs.
const MaxPluginAttrs = 32

// agentKeys are the keys the agent's own log line carries; a plugin attribute may not
// take one of them.
var agentKeys = map[string]bool{
	slog.TimeKey: true, slog.LevelKey: true, slog.MessageKey: true,
	"source": true, "pod_namespace": true, "pod_name": true, "plugin_time": true, "attrs_dropped": true,
}

// pluginLogAttrs turns a plugin's log record into the attributes of the agent's log
// line. What a client sends cannot forge the agent's fields: a key the agent uses
// (msg, level, time, source, pod_*) is prefixed with "plugin_", a key is at most 64
// characters of [A-Za-z0-9_.-] (others become "_"), and past MaxPluginAttrs (in key
// order) attributes are counted in attrs_dropped, not logged.
func pluginLogAttrs(r *agentsock.LogRecord) []slog.Attr {
	attrs := make([]slog.Attr, 0, min(len(r.Attrs), MaxPluginAttrs)+4)
	attrs = append(attrs,
		slog.String("pod_namespace", r.Pod.Namespace),
		slog.String("pod_name", r.Pod.Name),
		slog.Time("plugin_time", r.Time))
	keys := slices.Sorted(maps.Keys(r.Attrs))
	for i, k := range keys {
		if i == MaxPluginAttrs {
			attrs = append(attrs, slog.Int("attrs_dropped", len(keys)-MaxPluginAttrs))
			break
		}
		attrs = append(attrs, slog.Any(pluginKey(k), r.Attrs[k]))
	}
	return attrs
}

func pluginKey(k string) string {
	if len(k) > 64 {
		k = k[:64]
	}
	b := []byte(k)
	for i, c := range b {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '.' || c == '-') {
			b[i] = '_'
		}
	}
	k = string(b)
	if k == "" || agentKeys[k] {
		return "plugin_" + k
	}
	return k
}
