package agentsock

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"syscall"
	"testing"
)

// socketpair returns the two ends of a connected unix stream socket.
func socketpair(t *testing.T) (srv, cli *net.UnixConn) {
	t.Helper()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	conn := func(fd int) *net.UnixConn {
		f := os.NewFile(uintptr(fd), "socketpair")
		defer f.Close()
		c, err := net.FileConn(f)
		if err != nil {
			t.Fatal(err)
		}
		return c.(*net.UnixConn)
	}
	return conn(fds[0]), conn(fds[1])
}

// expected reads stream as the protocol defines it (one JSON Message per line, at
// most MaxLine bytes; a malformed or overlong line ends the connection) and counts
// what the server must hand on: log records, command results and the IDs of the
// requests it must answer, in order.
func expected(stream []byte) (logs, cmds int, ids []uint64) {
	sc := bufio.NewScanner(bytes.NewReader(stream))
	sc.Buffer(nil, MaxLine)
	for sc.Scan() {
		var m Message
		if json.Unmarshal(sc.Bytes(), &m) != nil {
			break
		}
		switch {
		case m.Kind == KindLog && m.Log != nil:
			logs++
		case m.Kind == KindCommand && m.Cmd != nil:
			cmds++
		case m.Kind == KindRequest && m.Req != nil:
			ids = append(ids, m.ID)
		}
	}
	return logs, cmds, ids
}

// FuzzServeConn sends a fuzzed byte stream to the server's connection handler over a
// real unix socket pair. The server hands on exactly the log records and command
// results of the well-formed lines before the first malformed one, answers each
// request there with one response line (kind resp, the protocol version, the
// request's ID, in order), and ends the connection when the stream ends.
func FuzzServeConn(f *testing.F) {
	for _, s := range []string{
		`{"v":1,"kind":"log","log":{"time":"2026-01-01T00:00:00Z","level":"INFO","msg":"hi","pod":{"namespace":"a","name":"b"},"attrs":{"k":1}}}` + "\n",
		`{"v":1,"kind":"cmd","cmd":{"command":"ADD","result":"success","duration_seconds":0.1,"pod":{"namespace":"a","name":"b"}}}` + "\n" +
			`{"v":1,"kind":"req","id":7,"req":{"type":"pod","body":{"namespace":"a","name":"b","uid":"u"}}}` + "\n",
		`{"v":1,"kind":"req","id":1,"req":{"type":"other"}}` + "\r\n" + `{"v":1,"kind":"release"}` + "\n" + `{"kind":"req","id":2}` + "\n",
		`{"v":1,"kind":"req","id":3,"req":{"type":"pod"}}` + "\nnot json\n" + `{"v":1,"kind":"req","id":4,"req":{"type":"pod"}}` + "\n",
		`{"v":1,"kind":"req","id":18446744073709551615,"req":{"type":"pod","body":null}}`,
		"\n\n{}\n", `{"kind":"log","log":{"time":"not a time"}}` + "\n", `{"v":1,"kind":"resp","resp":{"error":"x"}}` + "\n",
	} {
		f.Add([]byte(s))
	}
	logger := slog.New(slog.NewTextHandler(io.Discard, nil))
	f.Fuzz(func(t *testing.T, stream []byte) {
		srv, cli := socketpair(t)
		defer cli.Close()
		var logs, cmds int
		s := &Server{
			OnLog:     func(*LogRecord) { logs++ },
			OnCommand: func(*CommandResult) { cmds++ },
			OnRequest: func(_ context.Context, req *Request) (json.RawMessage, error) {
				if req.Type == RequestPod {
					return json.RawMessage(`{"found":false,"reason":"fuzz"}`), nil
				}
				return nil, ErrUnsupported
			},
			Linger: -1,
		}
		done := make(chan struct{})
		go func() {
			defer close(done)
			defer srv.Close()
			s.serveConn(context.Background(), srv, logger)
		}()
		go func() {
			_, _ = cli.Write(stream)
			_ = cli.CloseWrite()
		}()
		// A connection the server closes with bytes it did not read (after a malformed
		// line) ends in ECONNRESET for the client, after what the server wrote.
		out, err := io.ReadAll(cli)
		if err != nil && !errors.Is(err, syscall.ECONNRESET) {
			t.Fatalf("read responses: %v", err)
		}
		<-done
		wantLogs, wantCmds, wantIDs := expected(stream)
		if logs != wantLogs || cmds != wantCmds {
			t.Fatalf("server handed on %d logs, %d commands; want %d, %d", logs, cmds, wantLogs, wantCmds)
		}
		var ids []uint64
		for _, line := range bytes.SplitAfter(out, []byte("\n")) {
			if len(line) == 0 {
				continue
			}
			var m Message
			if line[len(line)-1] != '\n' || json.Unmarshal(line, &m) != nil || m.Kind != KindResponse || m.V != Version || m.Resp == nil {
				t.Fatalf("bad response line %q", line)
			}
			ids = append(ids, m.ID)
		}
		if len(ids) != len(wantIDs) {
			t.Fatalf("responses to IDs %v, want %v", ids, wantIDs)
		}
		for i := range ids {
			if ids[i] != wantIDs[i] {
				t.Fatalf("responses to IDs %v, want %v", ids, wantIDs)
			}
		}
	})
}
