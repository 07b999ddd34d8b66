package agent

import (
	"bytes"
	"encoding/json"
	"io"
	"log/slog"
	"strings"
	"testing"

	"k8s.io/klog/v2"
)

// TestLoggerRoutesKlog: what client-go logs through klog (informers, Events, leader
// election) reaches the agent's log in the agent's format: JSON lines by default, not
// klog's text format; slog's key=value text with --log-format text.
func TestLoggerRoutesKlog(t *testing.T) {
	var buf bytes.Buffer
	log := newLogger(&buf, slog.LevelInfo, "json")
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

	buf.Reset()
	log = newLogger(&buf, slog.LevelInfo, "text")
	log.Info("agent line")
	klog.InfoS("client-go line", "resource", "pods")
	klog.Flush()
	lines = strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 2 {
		t.Fatalf("text log has %d lines, want 2:\n%s", len(lines), buf.String())
	}
	for i, want := range []string{`msg="agent line"`, `msg="client-go line" resource=pods`} {
		if !strings.Contains(lines[i], want) || strings.HasPrefix(lines[i], "{") {
			t.Errorf("text line %d = %s, want slog text with %s", i, lines[i], want)
		}
	}
}

// TestLogFormatFlag: --log-format (or MESHCNI_LOG_FORMAT) is json by default, text on
// request, and anything else is refused with the value named.
func TestLogFormatFlag(t *testing.T) {
	base := []string{"--kubeconfig-source", "/k"}
	for _, tc := range []struct {
		args    []string
		env     string
		want    string
		wantErr string
	}{
		{want: "json"},
		{args: []string{"--log-format", "text"}, want: "text"},
		{env: "text", want: "text"},
		{args: []string{"--log-format", "logfmt"}, wantErr: `--log-format "logfmt": want json or text`},
	} {
		getenv := func(k string) string {
			if k == "MESHCNI_LOG_FORMAT" {
				return tc.env
			}
			return ""
		}
		c, err := ParseFlags(append(base, tc.args...), getenv, io.Discard)
		switch {
		case tc.wantErr != "":
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("%v: error %v, want %q", tc.args, err, tc.wantErr)
			}
		case err != nil:
			t.Errorf("%v: %v", tc.args, err)
		case c.LogFormat != tc.want:
			t.Errorf("%v env %q: LogFormat %q, want %q", tc.args, tc.env, c.LogFormat, tc.want)
		}
	}
}
