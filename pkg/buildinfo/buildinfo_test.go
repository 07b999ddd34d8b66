package buildinfo

import (
	"encoding/json"
	"io"
	"net/http/httptest"
	"runtime"
	"testing"
)

// TestHandler: GET /version is exactly {"version", "goVersion", "platform"}, the
// shape meshcnictl version reads.
func TestHandler(t *testing.T) {
	rec := httptest.NewRecorder()
	New("1.2.3").Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/version", nil))
	if rec.Code != 200 || rec.Header().Get("Content-Type") != "application/json" {
		t.Fatalf("status %d, content type %q", rec.Code, rec.Header().Get("Content-Type"))
	}
	body, _ := io.ReadAll(rec.Body)
	var got map[string]any
	if err := json.Unmarshal(body, &got); err != nil {
		t.Fatalf("%v: %s", err, body)
	}
	want := map[string]any{"version": "1.2.3", "goVersion": runtime.Version(), "platform": runtime.GOOS + "/" + runtime.GOARCH}
	if len(got) != len(want) {
		t.Errorf("keys %v, want exactly %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %v, want %v", k, got[k], v)
		}
	}
	if New("").Version != "dev" {
		t.Errorf("empty version: %q, want dev", New("").Version)
	}
}
