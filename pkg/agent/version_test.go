package agent

import (
	"encoding/json"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/meshcni/meshcni/internal/testkit/agenttest"
	"github.com/meshcni/meshcni/pkg/fileutil"
)

// TestVersionEndpoint: the health server answers GET /version with exactly the JSON
// meshcnictl version reads, and /metrics carries meshcni_build_info for the same build.
func TestVersionEndpoint(t *testing.T) {
	e := newEnv(t)
	if err := fileutil.WriteFileAtomic(filepath.Join(e.confDir, "10-calico.conflist"), []byte(calico), 0o644); err != nil {
		t.Fatal(err)
	}
	r := startAgentWith(t, e.args(), Options{Version: "1.2.3-test"}, nil)
	code, body := get(t, "http://"+r.addr+"/version")
	if code != 200 {
		t.Fatalf("/version = %d %s", code, body)
	}
	var got map[string]string
	if err := json.Unmarshal([]byte(body), &got); err != nil {
		t.Fatalf("/version: %v: %s", err, body)
	}
	want := map[string]string{"version": "1.2.3-test", "goVersion": runtime.Version(), "platform": runtime.GOOS + "/" + runtime.GOARCH}
	if len(got) != len(want) {
		t.Errorf("/version keys %v, want exactly %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("/version %s = %q, want %q", k, got[k], v)
		}
	}
	fams := scrape(t, r.addr)
	if v, ok := agenttest.Value(fams, "meshcni_build_info", map[string]string{"version": "1.2.3-test", "goversion": runtime.Version()}); !ok || v != 1 {
		t.Errorf("meshcni_build_info{version=1.2.3-test} = %v (present %v), want 1", v, ok)
	}
	if code, _ := get(t, "http://"+r.addr+"/healthz"); code != 200 {
		t.Errorf("/healthz = %d beside /version", code)
	}
}
