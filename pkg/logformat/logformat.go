// Package logformat builds the log of meshcni's long-running commands (the agent, the
// taint controller): slog JSON lines, the default, for log pipelines, or slog's
// key=value text for a human at a terminal. client-go's own logs (klog: informers,
// Events, leader election) go through the same handler, so a process writes one format.
package logformat

import (
	"fmt"
	"io"
	"log/slog"

	"k8s.io/klog/v2"
)

// The formats of --log-format.
const (
	JSON = "json"
	Text = "text"
)

// Usage is the help text of a --log-format flag.
const Usage = "log format: json (one JSON object a line) or text (slog key=value, for humans); client-go's logs use it too"

// Parse checks the value of flag (e.g. "--log-format").
func Parse(flag, s string) (string, error) {
	switch s {
	case JSON, Text:
		return s, nil
	}
	return "", fmt.Errorf("%s %q: want json or text", flag, s)
}

// New returns the log on w at level in format (Parse's result; anything else is
// JSON), and routes klog through it.
func New(w io.Writer, level slog.Level, format string) *slog.Logger {
	opts := &slog.HandlerOptions{Level: level}
	var h slog.Handler = slog.NewJSONHandler(w, opts)
	if format == Text {
		h = slog.NewTextHandler(w, opts)
	}
	log := slog.New(h)
	klog.SetSlogLogger(log)
	return log
}
