package agent

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	promtestutil "github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/meshcni/meshcni/pkg/agentsock"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/ebpf/sockmap"
)

// fakeAccel is the allow-list of a *sockmap.Accel, for the agent's decisions (the
// kernel's side is pkg/ebpf/sockmap's tests and TestTestbedEBPF).
type fakeAccel struct {
	allow  map[uint64]sockmap.Pod
	stats  sockmap.Stats
	closed bool
}

func (f *fakeAccel) Enable(c uint64, p sockmap.Pod) error { f.allow[c] = p; return nil }
func (f *fakeAccel) Disable(c uint64) error               { delete(f.allow, c); return nil }
func (f *fakeAccel) Enabled(c uint64) (bool, error)       { _, ok := f.allow[c]; return ok, nil }
func (f *fakeAccel) Stats() (sockmap.Stats, error)        { return f.stats, nil }
func (f *fakeAccel) Close() error                         { f.closed = true; return nil }

func newFakeEBPF(def capture.Acceleration, namespaces ...string) (*EBPF, *fakeAccel) {
	f := &fakeAccel{allow: map[uint64]sockmap.Pod{}}
	return &EBPF{Default: def, Namespaces: namespaces, Log: slog.New(slog.NewTextHandler(io.Discard, nil)), accel: f, pods: map[string]ebpfPod{}}, f
}

func add(id, ns, name, mode string, cookie uint64) *agentsock.CommandResult {
	return &agentsock.CommandResult{Command: agentsock.CommandAdd, Result: agentsock.ResultSuccess, ContainerID: id,
		Pod: agentsock.Pod{Namespace: ns, Name: name}, EBPF: &agentsock.PodEBPF{NetnsCookie: cookie, Mode: mode, ProxyUID: 1337, PodUID: "uid-" + name}}
}

// TestEBPFMode: the annotation wins; without it a listed namespace gets at least
// to-proxy, others the default.
func TestEBPFMode(t *testing.T) {
	for _, tt := range []struct {
		def  capture.Acceleration
		ns   string
		ann  capture.Acceleration
		want capture.Acceleration
	}{
		{capture.AccelOff, "app", capture.AccelDefault, capture.AccelOff},
		{capture.AccelOff, "fast", capture.AccelDefault, capture.AccelToProxy},
		{capture.AccelBoth, "fast", capture.AccelDefault, capture.AccelBoth},
		{capture.AccelToProxy, "app", capture.AccelDefault, capture.AccelToProxy},
		{capture.AccelBoth, "app", capture.AccelOff, capture.AccelOff},
		{capture.AccelOff, "fast", capture.AccelOff, capture.AccelOff},
		{capture.AccelOff, "app", capture.AccelBoth, capture.AccelBoth},
	} {
		e, _ := newFakeEBPF(tt.def, "fast")
		if got := e.Mode(tt.ns, tt.ann); got != tt.want {
			t.Errorf("default %q, namespace %s, annotation %q: %q, want %q", tt.def, tt.ns, tt.ann, got, tt.want)
		}
	}
}

// TestEBPFAllowedNamespaces: the operator's fence wins over a pod's annotation and
// over the defaults; inside it, everything is as without a fence.
func TestEBPFAllowedNamespaces(t *testing.T) {
	for _, tt := range []struct {
		def  capture.Acceleration
		ns   string
		ann  capture.Acceleration
		want capture.Acceleration
	}{
		{capture.AccelOff, "app", capture.AccelBoth, capture.AccelOff},
		{capture.AccelOff, "app", capture.AccelToProxy, capture.AccelOff},
		{capture.AccelBoth, "app", capture.AccelDefault, capture.AccelOff},
		{capture.AccelOff, "fast", capture.AccelBoth, capture.AccelBoth},
		{capture.AccelOff, "fast", capture.AccelDefault, capture.AccelToProxy},
		{capture.AccelOff, "other", capture.AccelDefault, capture.AccelOff},
		{capture.AccelOff, "other", capture.AccelToProxy, capture.AccelToProxy},
	} {
		e, _ := newFakeEBPF(tt.def, "fast")
		e.Allowed = []string{"fast", "other"}
		if got := e.Mode(tt.ns, tt.ann); got != tt.want {
			t.Errorf("allowed fast,other; default %q, namespace %s, annotation %q: %q, want %q", tt.def, tt.ns, tt.ann, got, tt.want)
		}
	}
	e, f := newFakeEBPF(capture.AccelOff)
	e.Allowed = []string{"fast"}
	e.OnCommand(add("s1", "app", "web", "both", 11))
	if len(f.allow) != 0 {
		t.Errorf("annotated pod outside the allowed namespaces enabled: %v", f.allow)
	}
}

// TestEBPFEnableDisable: an opted-in pod's ADD puts its cookie on the allow-list
// with its proxy UID and direction; a pod that did not opt in, a failed ADD and a
// report without details do not; the sandbox's DEL and the pod's deletion take it
// off, a newer pod of the same name keeps its own.
func TestEBPFEnableDisable(t *testing.T) {
	e, f := newFakeEBPF(capture.AccelOff)
	e.OnCommand(add("s1", "app", "web", "both", 11))
	e.OnCommand(add("s2", "app", "plain", "", 12))
	failed := add("s3", "app", "broken", "to-proxy", 13)
	failed.Result = agentsock.ResultError
	e.OnCommand(failed)
	e.OnCommand(&agentsock.CommandResult{Command: agentsock.CommandAdd, Result: agentsock.ResultSuccess, ContainerID: "s4", Pod: agentsock.Pod{Namespace: "app", Name: "off"}})
	e.OnCommand(add("s5", "app", "db", "to-proxy", 15))
	want := map[uint64]sockmap.Pod{11: {ProxyUID: 1337, ToApp: true}, 15: {ProxyUID: 1337}}
	if !equalAllow(f.allow, want) {
		t.Fatalf("allow-list %v, want %v", f.allow, want)
	}
	if ok, _ := e.PodAccelerated("app", "web"); !ok {
		t.Error("app/web not reported accelerated")
	}
	if ok, _ := e.PodAccelerated("app", "plain"); ok {
		t.Error("app/plain reported accelerated")
	}
	for cookie, want := range map[uint64]bool{11: true, 12: false} {
		if r, err := e.Answer(agentsock.EBPFRequest{NetnsCookie: cookie}); err != nil || !r.Available || r.Accelerated != want {
			t.Errorf("Answer(%d) = %+v, %v; want available, accelerated %v", cookie, r, err, want)
		}
	}
	e.OnCommand(&agentsock.CommandResult{Command: agentsock.CommandDel, Result: agentsock.ResultSuccess, ContainerID: "s1"})
	if _, ok := f.allow[11]; ok {
		t.Error("cookie 11 still allowed after its sandbox's DEL")
	}
	e.PodDeleted("app", "db", "uid-older")
	if _, ok := f.allow[15]; !ok {
		t.Error("an older pod's deletion disabled app/db's newer sandbox")
	}
	e.PodDeleted("app", "db", "uid-db")
	if len(f.allow) != 0 {
		t.Errorf("allow-list %v after every pod left", f.allow)
	}
}

func equalAllow(a, b map[uint64]sockmap.Pod) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}

// TestEBPFMetrics: the counters are read from Stats at each scrape.
func TestEBPFMetrics(t *testing.T) {
	e, f := newFakeEBPF(capture.AccelToProxy)
	e.OnCommand(add("s1", "app", "web", "", 11))
	f.stats = sockmap.Stats{Sockets: 2, Recorded: 4, Messages: 7, Bytes: 4096, Misses: 1}
	m := NewMetrics()
	m.Registry.MustRegister(e)
	const want = `
# HELP meshcni_ebpf_available 1 when eBPF acceleration is loaded on this node; 0 when off or unavailable (the log and /readyz say why).
# TYPE meshcni_ebpf_available gauge
meshcni_ebpf_available 1
# HELP meshcni_ebpf_accelerated_pods Pod sandboxes whose network namespace the agent enabled.
# TYPE meshcni_ebpf_accelerated_pods gauge
meshcni_ebpf_accelerated_pods 1
# HELP meshcni_ebpf_accelerated_sockets Open sockets in the sockhash (accelerated connections' ends).
# TYPE meshcni_ebpf_accelerated_sockets gauge
meshcni_ebpf_accelerated_sockets 2
# HELP meshcni_ebpf_redirected_bytes_total Bytes handed straight to the peer socket.
# TYPE meshcni_ebpf_redirected_bytes_total counter
meshcni_ebpf_redirected_bytes_total 4096
# HELP meshcni_ebpf_redirected_messages_total Messages handed straight to the peer socket.
# TYPE meshcni_ebpf_redirected_messages_total counter
meshcni_ebpf_redirected_messages_total 7
# HELP meshcni_ebpf_map_misses_total Messages whose peer socket was not in the map (sent through TCP).
# TYPE meshcni_ebpf_map_misses_total counter
meshcni_ebpf_map_misses_total 1
`
	if err := promtestutil.GatherAndCompare(m.Registry, strings.NewReader(want), "meshcni_ebpf_available", "meshcni_ebpf_accelerated_pods",
		"meshcni_ebpf_accelerated_sockets", "meshcni_ebpf_redirected_bytes_total", "meshcni_ebpf_redirected_messages_total", "meshcni_ebpf_map_misses_total"); err != nil {
		t.Error(err)
	}
}

// TestEBPFForcedUnavailable: a real agent whose feature detection is forced to
// fail runs and is ready; the reason is in its log and /readyz, the metric is 0,
// and a pod's report enables nothing.
func TestEBPFForcedUnavailable(t *testing.T) {
	e := newEnv(t)
	r := startAgent(t, e.args("--chained=false", "--ebpf-acceleration", "auto", "--ebpf-force-unavailable", "test: no kernel", "--ebpf-pin-dir", t.TempDir()+"/pins"), nil)
	eventually(t, 10*time.Second, "agent ready", r.a.Guard.Ready)
	resp, err := http.Get("http://" + r.addr + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(body), "ebpf acceleration: unavailable: eBPF acceleration unavailable: forced by setting: test: no kernel") {
		t.Errorf("/readyz = %d %q", resp.StatusCode, body)
	}
	if v := promtestutil.ToFloat64(r.a.EBPF); v != 0 {
		t.Errorf("meshcni_ebpf_available %v, want 0", v)
	}
	if !strings.Contains(r.log.String(), `"reason":"eBPF acceleration unavailable: forced by setting: test: no kernel"`) {
		t.Errorf("log lacks the reason:\n%s", r.log)
	}
	c, err := agentsock.Dial(e.runDir)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if a, err := c.EBPF(ctx, 11); err != nil || a.Available || a.Accelerated || !strings.Contains(a.Reason, "forced by setting: test: no kernel") {
		t.Errorf("agent socket eBPF answer %+v, %v", a, err)
	}
	r.a.EBPF.OnCommand(add("s1", "app", "web", "both", 11))
	if ok, err := r.a.EBPF.PodAccelerated("app", "web"); ok || err != nil {
		t.Errorf("PodAccelerated = %v, %v while unavailable", ok, err)
	}
}

// TestEBPFFlags: bad values are refused with the flag's name.
func TestEBPFFlags(t *testing.T) {
	e := newEnv(t)
	for _, tt := range []struct {
		args []string
		want string
	}{
		{[]string{"--ebpf-acceleration", "on"}, `--ebpf-acceleration "on": want off or auto`},
		{[]string{"--ebpf-default", "fast"}, `invalid --ebpf-default "fast": want off, to-proxy or both`},
	} {
		_, err := ParseFlags(e.args(tt.args...), func(string) string { return "" }, io.Discard)
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%v: %v, want %q", tt.args, err, tt.want)
		}
	}
	c, err := ParseFlags(e.args("--ebpf-acceleration", "auto", "--ebpf-default", "both", "--ebpf-namespaces", " a, b ,"), func(string) string { return "" }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.EBPF != EBPFAuto || c.EBPFDefault != capture.AccelBoth || strings.Join(c.EBPFNamespaces, "|") != "a|b" {
		t.Errorf("config %q %q %q", c.EBPF, c.EBPFDefault, c.EBPFNamespaces)
	}
	if _, err := ParseFlags(e.args(), func(string) string { return "" }, io.Discard); err != nil {
		t.Fatal(err)
	}
}
