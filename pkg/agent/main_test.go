package agent

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"strings"
	"testing"

	"k8s.io/klog/v2"
)

// TestLoggerRoutesKlog: what client-go logs through klog (informers, Events, leader
// election) reaches the agent's JSON log as JSON lines, not klog's text format.
func TestLoggerRoutesKlog(t *testing.T) {
	var buf bytes.Buffer
	log := newLogger(&buf, slog.LevelInfo)
	defer klog.ClearLogger()
	log.Info("agent line")
	klog.InfoS("client-go line", "resource", "pods")
	klog.Flush()
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 2 {
		t.Fatalf("log has %d lines, want 2:\n%s", len(lines), buf.String())
	}
	var rec map[string]any
	if err := json.Unmarshal([]byte(lines[1]), &rec); err != nil {
		t.Fatalf("klog's line is not JSON: %v\n%s", err, lines[1])
	}
	if rec["msg"] != "client-go line" || rec["resource"] != "pods" {
		t.Fatalf("klog's line = %v", rec)
	}
}
