package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/meshcni/meshcni/pkg/agentsock"
)

// TestPluginLogCannotForge: a client of the agent socket cannot forge the agent's log
// fields (msg, level, time, source, the pod) with attributes of its own, nor grow a
// line without bound.
func TestPluginLogCannotForge(t *testing.T) {
	attrs := map[string]any{
		"msg": "forged", "level": "ERROR", "time": "2000-01-01T00:00:00Z", "source": "agent",
		"pod_name": "someone-else", "err": "kept", "bad key=x\n": 1, "": "empty",
	}
	for i := range 40 {
		attrs[fmt.Sprintf("z%02d", i)] = i
	}
	rec := &agentsock.LogRecord{Time: time.Unix(1, 0), Level: "INFO", Msg: "real", Pod: agentsock.Pod{Namespace: "ns", Name: "web"}, Attrs: attrs}
	var buf bytes.Buffer
	slog.New(slog.NewJSONHandler(&buf, nil)).With("source", "plugin").LogAttrs(context.Background(), slog.LevelInfo, rec.Msg, pluginLogAttrs(rec)...)
	var line map[string]any
	if err := json.Unmarshal(buf.Bytes(), &line); err != nil {
		t.Fatalf("%v: %s", err, buf.String())
	}
	for k, want := range map[string]any{
		"msg": "real", "level": "INFO", "source": "plugin", "pod_name": "web", "pod_namespace": "ns",
		"plugin_msg": "forged", "plugin_level": "ERROR", "plugin_source": "agent", "plugin_pod_name": "someone-else",
		"err": "kept", "bad_key_x_": float64(1), "plugin_": "empty",
	} {
		if line[k] != want {
			t.Errorf("%s = %v, want %v (line %s)", k, line[k], want, buf.String())
		}
	}
	if got := line["attrs_dropped"]; got != float64(len(attrs)-MaxPluginAttrs) {
		t.Errorf("attrs_dropped = %v, want %d", got, len(attrs)-MaxPluginAttrs)
	}
	if n := len(line); n > MaxPluginAttrs+8 {
		t.Errorf("%d keys in one line, want at most %d", n, MaxPluginAttrs+8)
	}
}
