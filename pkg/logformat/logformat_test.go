package logformat

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"strings"
	"testing"

	"k8s.io/klog/v2"
)

// TestNewRoutesKlog: in either format, the process's own line and client-go's klog
// line come out in that one format (a JSON object, or slog's key=value text).
func TestNewRoutesKlog(t *testing.T) {
	for _, format := range []string{JSON, Text} {
		t.Run(format, func(t *testing.T) {
			var buf bytes.Buffer
			log := New(&buf, slog.LevelInfo, format)
			defer klog.ClearLogger()
			log.Info("own line", "k", "v")
			klog.InfoS("client-go line", "resource", "pods")
			klog.Flush()
			lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
			if len(lines) != 2 {
				t.Fatalf("%d lines, want 2:\n%s", len(lines), buf.String())
			}
			for i, want := range []map[string]string{{"msg": "own line", "k": "v"}, {"msg": "client-go line", "resource": "pods"}} {
				got := map[string]string{}
				if format == JSON {
					var rec map[string]any
					if err := json.Unmarshal([]byte(lines[i]), &rec); err != nil {
						t.Fatalf("line %d is not JSON: %v\n%s", i, err, lines[i])
					}
					for k, v := range rec {
						if s, ok := v.(string); ok {
							got[k] = s
						}
					}
				} else {
					if strings.HasPrefix(lines[i], "{") {
						t.Fatalf("line %d is JSON in text format: %s", i, lines[i])
					}
					for _, kv := range splitText(lines[i]) {
						k, v, _ := strings.Cut(kv, "=")
						got[k] = strings.Trim(v, `"`)
					}
				}
				for k, v := range want {
					if got[k] != v {
						t.Errorf("line %d: %s=%q, want %q (%s)", i, k, got[k], v, lines[i])
					}
				}
			}
		})
	}
}

// splitText splits a slog text line into key=value fields, keeping quoted values whole.
func splitText(line string) []string {
	var out []string
	var cur strings.Builder
	quoted := false
	for _, r := range line {
		switch {
		case r == '"':
			quoted = !quoted
		case r == ' ' && !quoted:
			out = append(out, cur.String())
			cur.Reset()
			continue
		}
		cur.WriteRune(r)
	}
	return append(out, cur.String())
}

func TestParse(t *testing.T) {
	for _, s := range []string{JSON, Text} {
		if got, err := Parse("--log-format", s); err != nil || got != s {
			t.Errorf("Parse(%q) = %q, %v", s, got, err)
		}
	}
	for _, s := range []string{"", "JSON", "logfmt"} {
		if _, err := Parse("--log-format", s); err == nil || !strings.Contains(err.Error(), `--log-format "`+s+`": want json or text`) {
			t.Errorf("Parse(%q) error = %v", s, err)
		}
	}
}
