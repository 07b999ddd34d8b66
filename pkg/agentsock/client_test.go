package agentsock

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"math"
	"strings"
	"testing"
	"time"
)

// The "cmd" and "release" lines are written without encoding/json: they must be the
// very bytes encoding/json writes.
func TestCommandLineIsJSONMarshal(t *testing.T) {
	strs := []string{"", "DEL", "default", "pod-abc-7d9f", `say "hi"`, `back\slash`, "<a>&b", "tab\there", "line\nbreak",
		"\x00\x01\x1f\x7f", "bell\b\f", "ünïcödé", "日本", "\u2028\u2029", "bad \xff utf8", "\xc3", "emoji 🙂"}
	floats := []float64{0, 1e-9, 1.5e-9, 5e-7, 9.99e-7, 1e-6, 0.000123, 0.0012345678, 0.5, 1, 1.5, 59.999999999,
		123456.789, 1e20, 1e21, 1.5e22, -0.25, -1e-8, (9 * time.Millisecond).Seconds(), time.Duration(math.MaxInt64).Seconds()}
	var results []*CommandResult
	for _, s := range strs {
		results = append(results,
			&CommandResult{Command: s, Result: ResultSuccess, Seconds: 0.004, Pod: Pod{Namespace: s, Name: "p"}},
			&CommandResult{Command: CommandDel, Result: s, Seconds: 0.004, Pod: Pod{Name: s}, ErrorMsg: s},
			&CommandResult{Command: CommandAdd, Result: ResultError, Pod: Pod{Namespace: "ns", Name: s}, ErrorMsg: "x: " + s},
		)
	}
	for _, s := range []string{"", "to-proxy", "both", `q"`} {
		results = append(results,
			&CommandResult{Command: CommandAdd, Result: ResultSuccess, ContainerID: "c0ffee" + s, EBPF: &PodEBPF{NetnsCookie: math.MaxUint64, Mode: s, ProxyUID: 1337, PodUID: s}},
			&CommandResult{Command: CommandDel, Result: ResultSuccess, ContainerID: s, EBPF: &PodEBPF{Mode: s}},
			&CommandResult{Command: CommandAdd, Result: ResultSuccess, ContainerID: s, Sandbox: &Sandbox{PodUID: s, Decision: DecisionSkipped, Reason: s, Netns: s, NetnsDev: 4, NetnsInode: math.MaxUint64, NetnsCookie: 9}},
			&CommandResult{Command: CommandAdd, Result: ResultSuccess, EBPF: &PodEBPF{}, Sandbox: &Sandbox{Decision: s}},
		)
	}
	for _, f := range floats {
		results = append(results, &CommandResult{Command: CommandCheck, Result: ResultSuccess, Seconds: f})
	}
	for _, r := range results {
		want, err := json.Marshal(&Message{V: Version, Kind: KindCommand, Cmd: r})
		if err != nil {
			t.Fatal(err)
		}
		want = append(want, '\n')
		if got := appendCommandLine(nil, r); !bytes.Equal(got, want) {
			t.Errorf("%+v:\n got %s\nwant %s", r, got, want)
		}
	}
	want, err := json.Marshal(&Message{V: Version, Kind: KindRelease})
	if err != nil {
		t.Fatal(err)
	}
	if got := releaseLine; got != string(want)+"\n" {
		t.Errorf("releaseLine = %q, want %q", got, string(want)+"\n")
	}
}

// countingHandler counts the handlers derived from it.
type countingHandler struct {
	slog.Handler
	derived *int
}

func (h countingHandler) WithAttrs(as []slog.Attr) slog.Handler {
	*h.derived++
	return countingHandler{h.Handler.WithAttrs(as), h.derived}
}

func (h countingHandler) WithGroup(name string) slog.Handler {
	*h.derived++
	return countingHandler{h.Handler.WithGroup(name), h.derived}
}

type lateValue struct{ v *string }

func (l lateValue) LogValue() slog.Value { return slog.StringValue(*l.v) }

// The fallback's WithAttrs/WithGroup are applied only when a record goes to it, and
// then it writes what the eagerly derived handler writes.
func TestFallbackDerivedLazily(t *testing.T) {
	noTime := func(_ []string, a slog.Attr) slog.Attr {
		if a.Key == slog.TimeKey {
			return slog.Attr{}
		}
		return a
	}
	var got, want bytes.Buffer
	derived := 0
	fb := countingHandler{slog.NewTextHandler(&got, &slog.HandlerOptions{Level: slog.LevelWarn, ReplaceAttr: noTime}), &derived}
	var c *Client // no agent: every record that is logged goes to the fallback
	late := "at With"
	log := slog.New(c.Handler(slog.LevelWarn, fb)).With("container_id", "0123", "late", lateValue{&late}).
		WithGroup("g").With(KeyPodName, "p", "err", errors.New("boom"))
	late = "changed later"
	ref := slog.New(slog.NewTextHandler(&want, &slog.HandlerOptions{Level: slog.LevelWarn, ReplaceAttr: noTime})).
		With("container_id", "0123", "late", lateValue{&[]string{"at With"}[0]}).
		WithGroup("g").With(KeyPodName, "p", "err", errors.New("boom"))

	if log.Enabled(context.Background(), slog.LevelInfo) {
		t.Error("Info enabled with agent and fallback at warn")
	}
	log.Info("dropped", "k", 1)
	if derived != 0 || got.Len() != 0 {
		t.Fatalf("nothing logged, yet %d fallback handlers derived, output %q", derived, got.String())
	}
	for _, l := range []*slog.Logger{log, ref} {
		l.Warn("first", "k", 1)
		l.With("more", true).Error("second", "d", time.Second)
	}
	if derived != 4 {
		t.Errorf("%d fallback handlers derived, want 4 (3 With/WithGroup, then 1 for the last record)", derived)
	}
	if got.String() != want.String() || !strings.Contains(got.String(), "late=\"at With\"") {
		t.Errorf("fallback wrote\n%s\nwant\n%s", got.String(), want.String())
	}
}
