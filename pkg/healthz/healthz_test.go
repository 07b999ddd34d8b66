package healthz

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

func TestServe(t *testing.T) {
	reg := prometheus.NewRegistry()
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "healthz_test_gauge", Help: "a gauge"})
	reg.MustRegister(g)
	g.Set(7)
	var isReady atomic.Bool
	ready := func() error {
		if isReady.Load() {
			return nil
		}
		return errors.New("binary missing")
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Serve(ctx, l, Handler(nil, ready, reg)) }()
	get := func(path string) (int, string) {
		resp, err := http.Get("http://" + l.Addr().String() + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	for _, tc := range []struct {
		path     string
		code     int
		contains string
	}{
		{"/healthz", 200, "ok"},
		{"/readyz", 503, "not ready: binary missing"},
		{"/metrics", 200, "healthz_test_gauge 7"},
	} {
		if code, body := get(tc.path); code != tc.code || !strings.Contains(body, tc.contains) {
			t.Errorf("GET %s = %d %q, want %d containing %q", tc.path, code, body, tc.code, tc.contains)
		}
	}
	isReady.Store(true)
	if code, _ := get("/readyz"); code != 200 {
		t.Errorf("GET /readyz once ready = %d, want 200", code)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Serve after cancel: %v", err)
	}
}
