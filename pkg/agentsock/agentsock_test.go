package agentsock

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

type collected struct {
	logs chan *LogRecord
	cmds chan *CommandResult
}

func startServer(t *testing.T, onReq func(context.Context, *Request) (json.RawMessage, error)) (string, *collected, context.CancelFunc, chan error) {
	return startServerWith(t, onReq, 50*time.Millisecond)
}

func startServerWith(t *testing.T, onReq func(context.Context, *Request) (json.RawMessage, error), linger time.Duration, opts ...func(*Server)) (string, *collected, context.CancelFunc, chan error) {
	t.Helper()
	dir := t.TempDir()
	c := &collected{logs: make(chan *LogRecord, 100), cmds: make(chan *CommandResult, 100)}
	s := &Server{Path: Path(dir), OnLog: func(r *LogRecord) { c.logs <- r }, OnCommand: func(r *CommandResult) { c.cmds <- r }, OnRequest: onReq, Linger: linger}
	for _, o := range opts {
		o(s)
	}
	ctx, cancel := context.WithCancel(context.Background())
	l, err := Listen(s.Path)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	finished := make(chan struct{})
	go func() { done <- s.ServeListener(ctx, l); close(finished) }()
	t.Cleanup(func() { cancel(); <-finished })
	return dir, c, cancel, done
}

// syncBuffer is a bytes.Buffer safe for a logger and a reader at once.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func recv[T any](t *testing.T, ch chan T) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(5 * time.Second):
		t.Fatal("timed out waiting for a message")
	}
	var zero T
	return zero
}

func TestLogAndCommandRoundTrip(t *testing.T) {
	dir, got, _, _ := startServer(t, nil)
	fi, err := os.Stat(Path(dir))
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 || fi.Mode()&os.ModeSocket == 0 {
		t.Errorf("socket mode %v, want socket 0600", fi.Mode())
	}
	c, err := Dial(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()

	log := slog.New(c.Handler(slog.LevelDebug, nil)).With(KeyPodNamespace, "default", KeyPodName, "web-0")
	for _, tc := range []struct {
		name  string
		do    func()
		level string
		msg   string
		attrs map[string]any
	}{
		{"plain", func() { log.Info("redirect applied", "backend", "nftables", "rules", 12) },
			"INFO", "redirect applied", map[string]any{"backend": "nftables", "rules": float64(12)}},
		{"error and group", func() {
			log.WithGroup("netns").Error("apply failed", "path", "/run/netns/x", "err", errors.New("boom"), slog.Group("t", "ms", 3))
		}, "ERROR", "apply failed", map[string]any{"netns.path": "/run/netns/x", "netns.err": "boom", "netns.t.ms": float64(3)}},
		{"debug", func() { log.Debug("d", "dur", 1500*time.Millisecond) }, "DEBUG", "d", map[string]any{"dur": "1.5s"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.do()
			r := recv(t, got.logs)
			if r.Level != tc.level || r.Msg != tc.msg || r.Pod != (Pod{Namespace: "default", Name: "web-0"}) {
				t.Errorf("record = %+v", r)
			}
			for k, v := range tc.attrs {
				if r.Attrs[k] != v {
					t.Errorf("attr %s = %#v, want %#v (all: %v)", k, r.Attrs[k], v, r.Attrs)
				}
			}
			if len(r.Attrs) != len(tc.attrs) {
				t.Errorf("attrs = %v, want %v", r.Attrs, tc.attrs)
			}
		})
	}

	if err := c.ReportCommand(CommandAdd, ResultError, 42*time.Millisecond, Pod{"ns", "p"}, errors.New("no netns")); err != nil {
		t.Fatal(err)
	}
	r := recv(t, got.cmds)
	want := CommandResult{Command: "ADD", Result: "error", Seconds: 0.042, Pod: Pod{"ns", "p"}, ErrorMsg: "no netns"}
	if *r != want {
		t.Errorf("command = %+v, want %+v", *r, want)
	}
}

func TestRequests(t *testing.T) {
	dir, _, _, _ := startServer(t, func(_ context.Context, r *Request) (json.RawMessage, error) {
		if r.Type != "echo" {
			return nil, ErrUnsupported
		}
		return r.Body, nil
	})
	c, err := Dial(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	var out map[string]string
	if err := c.Call(ctx, "echo", map[string]string{"a": "b"}, &out); err != nil || out["a"] != "b" {
		t.Errorf("echo = %v, %v", out, err)
	}
	if err := c.Call(ctx, "pod", nil, nil); err == nil || !strings.Contains(err.Error(), "unsupported") {
		t.Errorf("unknown request = %v, want unsupported", err)
	}
	// One-way messages still flow on the same connection.
	if err := c.ReportCommand(CommandDel, ResultSuccess, time.Millisecond, Pod{}, nil); err != nil {
		t.Error(err)
	}
}

func TestNoAgent(t *testing.T) {
	dir := t.TempDir()
	c, err := Dial(dir)
	if err == nil {
		t.Fatal("Dial without an agent succeeded")
	}
	// A nil client is usable: no-ops, and the handler falls back.
	if err := c.ReportCommand(CommandAdd, ResultSuccess, 0, Pod{}, nil); !errors.Is(err, ErrClosed) {
		t.Errorf("ReportCommand on nil = %v", err)
	}
	var buf bytes.Buffer
	slog.New(c.Handler(slog.LevelInfo, slog.NewJSONHandler(&buf, nil))).Info("hello", KeyPodName, "p")
	if !strings.Contains(buf.String(), `"msg":"hello"`) || !strings.Contains(buf.String(), `"pod_name":"p"`) {
		t.Errorf("fallback got %q", buf.String())
	}
	if c.Close() != nil || c.Connected() {
		t.Error("nil client Close/Connected")
	}
}

func TestAgentGoneFallsBack(t *testing.T) {
	dir, got, cancel, done := startServer(t, nil)
	c, err := Dial(dir)
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	log := slog.New(c.Handler(slog.LevelInfo, slog.NewTextHandler(&buf, nil)))
	log.Info("first")
	recv(t, got.logs)
	cancel()
	<-done
	if _, err := os.Stat(Path(dir)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("socket left after shutdown: %v", err)
	}
	// The first writes after the agent closed may still succeed into the dead socket's
	// buffer; within a few the client notices and falls back.
	for i := 0; i < 100 && c.Connected(); i++ {
		log.Info("later")
		time.Sleep(time.Millisecond)
	}
	if c.Connected() {
		t.Fatal("client still connected to a stopped agent")
	}
	if !strings.Contains(buf.String(), "later") {
		t.Errorf("fallback got %q", buf.String())
	}
}

// stuckAgent listens on dir's socket, accepts every connection and never reads; it
// holds them until the test ends.
func stuckAgent(tb testing.TB, dir string) {
	tb.Helper()
	l, err := net.Listen("unix", Path(dir))
	if err != nil {
		tb.Fatal(err)
	}
	done := make(chan struct{})
	var held []net.Conn
	go func() {
		defer close(done)
		for {
			conn, err := l.Accept()
			if err != nil {
				for _, c := range held {
					c.Close()
				}
				return
			}
			held = append(held, conn)
		}
	}()
	tb.Cleanup(func() { l.Close(); <-done })
}

// fillStuck writes 4 KiB commands into a connection nobody reads until the client
// gives up on it (at most 2000); it returns the slowest write and how many there were.
func fillStuck(c *Client) (worst time.Duration, n int) {
	attrs := strings.Repeat("x", 4096)
	for n < 2000 && c.Connected() {
		start := time.Now()
		_ = c.ReportCommand(CommandAdd, ResultSuccess, 0, Pod{Name: attrs}, nil)
		worst = max(worst, time.Since(start))
		n++
	}
	return worst, n
}

// An agent that accepts but never reads cannot block the plugin: the client drops the
// connection (and falls back) while the agent still holds it open. How long the
// slowest write takes is BenchmarkReportCommandStuckAgent's figure.
func TestStuckAgentNeverBlocks(t *testing.T) {
	dir := t.TempDir()
	stuckAgent(t, dir)
	c, err := Dial(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	filled := make(chan struct{})
	go func() { defer close(filled); fillStuck(c) }()
	select {
	case <-filled:
	case <-time.After(30 * time.Second): // only a hung write gets here
		t.Fatal("ReportCommand blocked on an agent that never reads")
	}
	if c.Connected() {
		t.Fatal("8 MiB into a socket nobody reads, and still connected")
	}
}

// BenchmarkReportCommandStuckAgent measures what an agent that never reads costs the
// plugin: per iteration a new connection is filled until the client drops it.
// ns/op is the time until the client gives up; reported besides: the slowest single
// ReportCommand of a connection (WriteTimeout bounds each write; median and maximum
// over the iterations) and the writes it took to give up.
func BenchmarkReportCommandStuckAgent(b *testing.B) {
	dir := b.TempDir()
	stuckAgent(b, dir)
	var worst []time.Duration
	writes := 0
	for b.Loop() {
		c, err := Dial(dir)
		if err != nil {
			b.Fatal(err)
		}
		w, n := fillStuck(c)
		if c.Connected() {
			b.Fatal("still connected to an agent that never reads")
		}
		c.Close()
		worst, writes = append(worst, w), writes+n
	}
	slices.Sort(worst)
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	b.ReportMetric(ms(worst[len(worst)/2]), "worst-write-p50-ms")
	b.ReportMetric(ms(worst[len(worst)-1]), "worst-write-max-ms")
	b.ReportMetric(float64(writes)/float64(b.N), "writes/op")
}

// BenchmarkDialNoAgent measures Dial when no agent listens (the plugin's cost on a
// node without the agent): it must fail at once, never wait.
func BenchmarkDialNoAgent(b *testing.B) {
	dir := b.TempDir()
	for b.Loop() {
		if c, err := Dial(dir); err == nil {
			c.Close()
			b.Fatal("Dial without an agent succeeded")
		}
	}
}

func TestMalformedLineClosesConnection(t *testing.T) {
	dir, got, _, _ := startServer(t, nil)
	conn, err := net.Dial("unix", filepath.Join(dir, SocketName))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.Write([]byte("{not json\n" + `{"v":1,"kind":"cmd","cmd":{"command":"ADD"}}` + "\n"))
	conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := conn.Read(make([]byte, 1)); err == nil {
		t.Error("connection still open after a malformed line")
	}
	select {
	case r := <-got.cmds:
		t.Errorf("message after a malformed line was handled: %+v", r)
	default:
	}
}

func BenchmarkReportCommand(b *testing.B) {
	dir := b.TempDir()
	s := &Server{Path: Path(dir), OnCommand: func(*CommandResult) {}}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	l, err := Listen(s.Path)
	if err != nil {
		b.Fatal(err)
	}
	go s.ServeListener(ctx, l)
	c, err := Dial(dir)
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	b.ResetTimer()
	for b.Loop() {
		if err := c.ReportCommand(CommandAdd, ResultSuccess, time.Millisecond, Pod{"ns", "p"}, nil); err != nil {
			b.Fatal(err)
		}
	}
}

func TestGetPod(t *testing.T) {
	dir, _, _, _ := startServer(t, func(_ context.Context, r *Request) (json.RawMessage, error) {
		if r.Type != RequestPod {
			return nil, ErrUnsupported
		}
		var pr PodRequest
		if err := json.Unmarshal(r.Body, &pr); err != nil {
			return nil, err
		}
		switch pr.Name {
		case "web":
			return json.Marshal(PodResponse{Found: true, Pod: json.RawMessage(`{"metadata":{"namespace":"` + pr.Namespace + `","name":"web","uid":"` + pr.UID + `"}}`)})
		case "broken":
			return json.Marshal(PodResponse{Found: true})
		}
		return json.Marshal(PodResponse{Reason: "not cached"})
	})
	c, err := Dial(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	for _, tc := range []struct {
		name, wantPod, wantReason, wantErr string
	}{
		{"web", `{"metadata":{"namespace":"ns","name":"web","uid":"u1"}}`, "", ""},
		{"other", "", "not cached", ""},
		{"broken", "", "", "found without a pod"},
	} {
		resp, err := c.GetPod(ctx, PodRequest{Namespace: "ns", Name: tc.name, UID: "u1"})
		if tc.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("%s: error %v, want %q", tc.name, err, tc.wantErr)
			}
			continue
		}
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if resp.Found != (tc.wantPod != "") || string(resp.Pod) != tc.wantPod || resp.Reason != tc.wantReason {
			t.Errorf("%s: got %+v", tc.name, resp)
		}
	}
	var nilClient *Client
	if _, err := nilClient.GetPod(ctx, PodRequest{Namespace: "ns", Name: "web"}); !errors.Is(err, ErrClosed) {
		t.Errorf("GetPod on a nil client = %v", err)
	}
}

// TestRelease: descriptors handed to the agent are held until the connection ends,
// then closed by it. The write end of a pipe goes over; after the sender has closed
// its own copy the reader does not see EOF while the connection is open (the agent
// holds it), and sees EOF once the connection is closed (the agent closed it last).
// The stream goes on after the release message.
func TestRelease(t *testing.T) {
	dir, got, _, _ := startServer(t, nil)
	c, err := Dial(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if err := c.Release(int(w.Fd())); err != nil {
		t.Fatal(err)
	}
	w.Close()
	if err := c.ReportCommand(CommandDel, ResultSuccess, time.Millisecond, Pod{Namespace: "ns", Name: "p"}, nil); err != nil {
		t.Fatal(err)
	}
	if cmd := recv(t, got.cmds); cmd.Command != CommandDel || cmd.Pod.Name != "p" {
		t.Fatalf("command after release = %+v", cmd)
	}
	// The release was read before the command: the agent holds the descriptor now.
	if err := r.SetReadDeadline(time.Now().Add(50 * time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	if n, err := r.Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read while the connection is open = %d, %v; want a timeout (the agent holds the write end)", n, err)
	}
	c.Close()
	if err := r.SetReadDeadline(time.Now().Add(5 * time.Second)); err != nil {
		t.Fatal(err)
	}
	if n, err := r.Read(make([]byte, 1)); n != 0 || !errors.Is(err, io.EOF) {
		t.Fatalf("read after the connection closed = %d, %v; want EOF (the agent closed its copy)", n, err)
	}
	var nilClient *Client
	if err := nilClient.Release(1); !errors.Is(err, ErrClosed) {
		t.Errorf("Release on a nil client = %v", err)
	}
}

// pipes makes n pipes and returns their read and write ends.
func pipes(t *testing.T, n int) (rs, ws []int) {
	t.Helper()
	for range n {
		var p [2]int
		if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
			t.Fatal(err)
		}
		rs, ws = append(rs, p[0]), append(ws, p[1])
	}
	t.Cleanup(func() {
		for _, fd := range rs {
			unix.Close(fd)
		}
	})
	return rs, ws
}

// hungUp reports, for each pipe read end, whether every write end is closed, waiting up
// to timeout for all of them.
func hungUp(t *testing.T, rs []int, timeout time.Duration) []bool {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		pfds := make([]unix.PollFd, len(rs))
		for i, fd := range rs {
			pfds[i] = unix.PollFd{Fd: int32(fd), Events: unix.POLLIN}
		}
		if _, err := unix.Poll(pfds, 0); err != nil && !errors.Is(err, unix.EINTR) {
			t.Fatal(err)
		}
		out := make([]bool, len(rs))
		all := true
		for i, p := range pfds {
			out[i] = p.Revents&unix.POLLHUP != 0
			all = all && out[i]
		}
		if all || time.Now().After(deadline) {
			return out
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestReleaseBound: the agent holds at most MaxHeldFDs descriptors per connection; the
// ones past it are closed as they arrive, the held ones when the connection ends.
func TestReleaseBound(t *testing.T) {
	dir, got, _, _ := startServer(t, nil)
	c, err := Dial(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	const extra = 5
	rs, ws := pipes(t, MaxHeldFDs+extra)
	for i := 0; i < len(ws); i += 8 {
		if err := c.Release(ws[i:min(i+8, len(ws))]...); err != nil {
			t.Fatal(err)
		}
	}
	for _, fd := range ws {
		unix.Close(fd)
	}
	if err := c.ReportCommand(CommandDel, ResultSuccess, time.Millisecond, Pod{Namespace: "ns", Name: "p"}, nil); err != nil {
		t.Fatal(err)
	}
	recv(t, got.cmds) // every release message was read before it
	for i, hup := range hungUp(t, rs, 0) {
		if want := i >= MaxHeldFDs; hup != want {
			t.Fatalf("pipe %d: closed by the agent %v, want %v (it holds the first %d)", i, hup, want, MaxHeldFDs)
		}
	}
	c.Close()
	for i, hup := range hungUp(t, rs, 5*time.Second) {
		if !hup {
			t.Fatalf("pipe %d still held after the connection ended", i)
		}
	}
}

// TestReleaseLinger: released descriptors outlive their connection by Linger (so
// their close, which may wait for an RCU grace period holding the pod netns's nftables
// lock, happens after the grace period), then are closed; Linger < 0 closes at once.
func TestReleaseLinger(t *testing.T) {
	for _, tc := range []struct {
		linger   time.Duration
		heldLate bool // held for the linger after the connection ended
	}{{3 * time.Second, true}, {-1, false}} {
		t.Run(tc.linger.String(), func(t *testing.T) {
			dir, got, _, _ := startServerWith(t, nil, tc.linger)
			c, err := Dial(dir)
			if err != nil {
				t.Fatal(err)
			}
			rs, ws := pipes(t, 2)
			if err := c.Release(ws...); err != nil {
				t.Fatal(err)
			}
			for _, fd := range ws {
				unix.Close(fd)
			}
			if err := c.ReportCommand(CommandAdd, ResultSuccess, time.Millisecond, Pod{Namespace: "ns", Name: "p"}, nil); err != nil {
				t.Fatal(err)
			}
			recv(t, got.cmds)
			closed := time.Now()
			c.Close()
			for i, hup := range hungUp(t, rs, max(tc.linger, 0)+5*time.Second) {
				if !hup {
					t.Fatalf("pipe %d still held %v after the connection ended", i, max(tc.linger, 0)+5*time.Second)
				}
			}
			// The agent's linger starts when it sees the connection end, after closed.
			if held := time.Since(closed); tc.heldLate && held < tc.linger {
				t.Fatalf("pipes closed %v after the connection's end; linger %v", held, tc.linger)
			}
		})
	}
}

// TestServerBounds: past MaxConns a new connection is closed at once (the ones
// served are untouched), and a connection idle past IdleTimeout is closed.
func TestServerBounds(t *testing.T) {
	dir := t.TempDir()
	logs := make(chan *LogRecord, 10)
	s := &Server{Path: Path(dir), MaxConns: 3, IdleTimeout: 300 * time.Millisecond, Logger: slog.New(slog.DiscardHandler),
		OnLog: func(r *LogRecord) { logs <- r }}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	dial := func() net.Conn {
		t.Helper()
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
			c, err := net.Dial("unix", Path(dir))
			if err == nil {
				t.Cleanup(func() { c.Close() })
				return c
			}
			if time.Now().After(deadline) {
				t.Fatal(err)
			}
		}
	}
	// closedWithin reports whether the server closed c within d.
	closedWithin := func(c net.Conn, d time.Duration) bool {
		_ = c.SetReadDeadline(time.Now().Add(d))
		_, err := c.Read(make([]byte, 1))
		return errors.Is(err, io.EOF)
	}
	var served []net.Conn
	for range 3 {
		c := dial()
		served = append(served, c)
		// A log line keeps it busy (not idle) and proves it is served.
		if _, err := c.Write([]byte(`{"v":1,"kind":"log","log":{"level":"INFO","msg":"x"}}` + "\n")); err != nil {
			t.Fatal(err)
		}
	}
	for range 3 { // the server has accepted and served the three
		recv(t, logs)
	}
	if extra := dial(); !closedWithin(extra, 2*time.Second) {
		t.Fatal("a connection past MaxConns was not closed")
	}
	// Still served after the refusal: a new line on each arrives (this also restarts
	// its idle timer, so a loaded machine cannot mistake idling for the refusal).
	for i, c := range served {
		if _, err := c.Write([]byte(`{"v":1,"kind":"log","log":{"level":"INFO","msg":"again"}}` + "\n")); err != nil {
			t.Fatalf("served connection %d closed by the refusal of another: %v", i, err)
		}
		if r := recv(t, logs); r.Msg != "again" {
			t.Fatalf("served connection %d: got %q", i, r.Msg)
		}
	}
	// Idle: each is closed about IdleTimeout after its last message.
	for i, c := range served {
		if !closedWithin(c, 5*time.Second) {
			t.Fatalf("connection %d idle past IdleTimeout still open", i)
		}
	}
	// Room again: a new connection is served.
	c := dial()
	if closedWithin(c, 100*time.Millisecond) {
		t.Fatal("a connection after the others ended was refused")
	}
}

// TestReleaseClosedOnShutdown: when the agent stops, it closes the descriptors of the
// connections still open.
func TestReleaseClosedOnShutdown(t *testing.T) {
	dir, got, cancel, done := startServer(t, nil)
	c, err := Dial(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	rs, ws := pipes(t, 1)
	if err := c.Release(ws[0]); err != nil {
		t.Fatal(err)
	}
	unix.Close(ws[0])
	if err := c.ReportCommand(CommandDel, ResultSuccess, time.Millisecond, Pod{Namespace: "ns", Name: "p"}, nil); err != nil {
		t.Fatal(err)
	}
	recv(t, got.cmds)
	if hungUp(t, rs, 0)[0] {
		t.Fatal("descriptor closed while the connection is open")
	}
	cancel()
	if err := recv(t, done); err != nil {
		t.Fatalf("Serve = %v", err)
	}
	if !hungUp(t, rs, 5*time.Second)[0] {
		t.Fatal("descriptor still held after the agent stopped")
	}
}

// TestListenMode: whatever the umask (0 here: bind would give 0777), the socket is in
// place with mode 0600, a stale socket is replaced, and nothing else is left in the
// directory (the private directory it was bound in is gone).
func TestListenMode(t *testing.T) {
	old := unix.Umask(0)
	defer unix.Umask(old)
	dir := t.TempDir()
	path := Path(dir)
	for i := range 2 { // the second replaces the first's (stale) socket
		l, err := Listen(path)
		if err != nil {
			t.Fatal(err)
		}
		fi, err := os.Lstat(path)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != 0o600 || fi.Mode()&os.ModeSocket == 0 {
			t.Fatalf("listen %d: mode %v, want a socket with mode 0600", i, fi.Mode())
		}
		ents, err := os.ReadDir(dir)
		if err != nil {
			t.Fatal(err)
		}
		if len(ents) != 1 || ents[0].Name() != SocketName {
			t.Fatalf("listen %d: directory holds %v, want only %s", i, ents, SocketName)
		}
		c, err := net.Dial("unix", path)
		if err != nil {
			t.Fatalf("listen %d: dial: %v", i, err)
		}
		c.Close()
		l.Close()
	}
}

// TestAcceptOutOfDescriptors: an accept that fails because the process has no
// descriptor left (EMFILE) does not stop the server; the waiting connection is served
// once descriptors are free again.
func TestAcceptOutOfDescriptors(t *testing.T) {
	var logs syncBuffer
	dir, got, _, done := startServerWith(t, nil, 50*time.Millisecond, func(s *Server) {
		s.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	})
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	maxFD := 0
	for _, e := range ents {
		var fd int
		if _, err := fmt.Sscan(e.Name(), &fd); err == nil && fd > maxFD {
			maxFD = fd
		}
	}
	low := lim
	low.Cur = uint64(maxFD + 64)
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &low); err != nil {
		t.Fatal(err)
	}
	defer unix.Setrlimit(unix.RLIMIT_NOFILE, &lim)
	var fill []int
	defer func() {
		for _, fd := range fill {
			unix.Close(fd)
		}
	}()
	for {
		fd, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if errors.Is(err, unix.EMFILE) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		fill = append(fill, fd)
	}
	// One descriptor for the client; none is left for the server's accept.
	unix.Close(fill[len(fill)-1])
	fill = fill[:len(fill)-1]
	c, err := Dial(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := c.ReportCommand(CommandAdd, ResultSuccess, time.Millisecond, Pod{Namespace: "ns", Name: "p"}, nil); err != nil {
		t.Fatal(err)
	}
	// The server tried to accept the connection and failed for want of a descriptor.
	for deadline := time.Now().Add(5 * time.Second); !strings.Contains(logs.String(), "accept, retrying"); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("no failed accept logged within 5s:\n%s", logs.String())
		}
	}
	select {
	case err := <-done:
		t.Fatalf("server stopped while out of descriptors: %v", err)
	case <-got.cmds:
		t.Fatal("served without a descriptor to accept with")
	default:
	}
	for _, fd := range fill {
		unix.Close(fd)
	}
	fill = nil
	if cmd := recv(t, got.cmds); cmd.Command != CommandAdd || cmd.Pod.Name != "p" {
		t.Fatalf("command = %+v", cmd)
	}
}
