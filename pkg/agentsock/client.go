package agentsock

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"syscall"
	"time"
)

// Timeouts of the client. A CNI ADD never waits longer than this on the agent.
const (
	DialTimeout  = 20 * time.Millisecond
	WriteTimeout = 5 * time.Millisecond
)

// ErrClosed: the connection to the agent is gone; the client dropped the message.
var ErrClosed = errors.New("agentsock: no connection to the agent")

// Client is the plugin's connection to the agent. Its methods are safe for concurrent
// use, and on a nil *Client they are no-ops, so a plugin can keep a nil client when
// Dial failed.
type Client struct {
	mu     sync.Mutex
	conn   net.Conn
	r      *bufio.Reader
	broken bool
	nextID uint64
}

// Dial connects to the agent's socket in runDir, failing fast (DialTimeout) when no
// agent listens there.
func Dial(runDir string) (*Client, error) {
	d := net.Dialer{Timeout: DialTimeout}
	conn, err := d.Dial("unix", Path(runDir))
	if err != nil {
		return nil, fmt.Errorf("agentsock: dial: %w", err)
	}
	return &Client{conn: conn, r: bufio.NewReader(conn)}, nil
}

// Close closes the connection.
func (c *Client) Close() error {
	if c == nil {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.broken = true
	return c.conn.Close()
}

// Connected reports whether messages still reach the agent.
func (c *Client) Connected() bool {
	if c == nil {
		return false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return !c.broken
}

func (c *Client) send(m *Message) error {
	m.V = Version
	line, err := json.Marshal(m)
	if err != nil {
		return fmt.Errorf("agentsock: encode: %w", err)
	}
	line = append(line, '\n')
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.writeLocked(line)
}

func (c *Client) writeLocked(line []byte) error {
	if c.broken {
		return ErrClosed
	}
	if err := c.conn.SetWriteDeadline(time.Now().Add(WriteTimeout)); err != nil {
		c.fail()
		return ErrClosed
	}
	if _, err := c.conn.Write(line); err != nil {
		// A partial line would corrupt the stream: drop the connection.
		c.fail()
		return fmt.Errorf("%w: %v", ErrClosed, err)
	}
	return nil
}

func (c *Client) fail() {
	c.broken = true
	c.conn.Close()
}

// ReportCommand sends the outcome of a CNI command (CommandAdd, ResultSuccess, …). A
// send failure is returned but needs no handling: the agent is gone.
func (c *Client) ReportCommand(command, result string, d time.Duration, pod Pod, cmdErr error) error {
	if c == nil {
		return ErrClosed
	}
	r := &CommandResult{Command: command, Result: result, Seconds: d.Seconds(), Pod: pod}
	if cmdErr != nil {
		r.ErrorMsg = cmdErr.Error()
	}
	return c.send(&Message{Kind: KindCommand, Cmd: r})
}

// Call sends a request and waits for its response until ctx ends.
func (c *Client) Call(ctx context.Context, typ string, body, out any) error {
	if c == nil {
		return ErrClosed
	}
	req := &Request{Type: typ}
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return fmt.Errorf("agentsock: encode request: %w", err)
		}
		req.Body = b
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.nextID++
	id := c.nextID
	line, err := json.Marshal(&Message{V: Version, Kind: KindRequest, ID: id, Req: req})
	if err != nil {
		return fmt.Errorf("agentsock: encode request: %w", err)
	}
	if err := c.writeLocked(append(line, '\n')); err != nil {
		return err
	}
	deadline, ok := ctx.Deadline()
	if !ok {
		deadline = time.Now().Add(time.Second)
	}
	if err := c.conn.SetReadDeadline(deadline); err != nil {
		c.fail()
		return ErrClosed
	}
	for {
		resp, err := c.r.ReadBytes('\n')
		if err != nil {
			c.fail()
			return fmt.Errorf("%w: read response: %v", ErrClosed, err)
		}
		var m Message
		if err := json.Unmarshal(resp, &m); err != nil {
			c.fail()
			return fmt.Errorf("agentsock: decode response: %w", err)
		}
		if m.Kind != KindResponse || m.ID != id || m.Resp == nil {
			continue
		}
		if m.Resp.Error != "" {
			return fmt.Errorf("agentsock: %s: %s", typ, m.Resp.Error)
		}
		if out != nil {
			return json.Unmarshal(m.Resp.Body, out)
		}
		return nil
	}
}

// GetPod asks the agent for a pod from its cache of the node's pods, waiting until ctx
// ends. An error means the agent could not be asked (no agent, an older agent that
// does not know the request, a timeout); a PodResponse with Found false means it was
// asked and does not have the pod.
func (c *Client) GetPod(ctx context.Context, req PodRequest) (*PodResponse, error) {
	var resp PodResponse
	if err := c.Call(ctx, RequestPod, req, &resp); err != nil {
		return nil, err
	}
	if resp.Found && len(resp.Pod) == 0 {
		return nil, fmt.Errorf("agentsock: %s: found without a pod", RequestPod)
	}
	return &resp, nil
}

// Release hands file descriptors to the agent, which holds them (up to MaxHeldFDs)
// until this connection is closed and then closes them: the caller closes its own
// copies (before Close) without being the last holder. The descriptors travel with a
// "release" message (SCM_RIGHTS) and are duplicated by the kernel, so the caller
// always closes its own copies, whatever Release returns. An error means they may not
// have reached the agent (a write that failed part-way may have carried them; the
// connection is then dropped and the agent closes them at once).
func (c *Client) Release(fds ...int) error {
	if c == nil {
		return ErrClosed
	}
	uc, ok := c.conn.(*net.UnixConn)
	if !ok || len(fds) == 0 {
		return ErrClosed
	}
	line, err := json.Marshal(&Message{V: Version, Kind: KindRelease})
	if err != nil {
		return fmt.Errorf("agentsock: encode: %w", err)
	}
	line = append(line, '\n')
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.broken {
		return ErrClosed
	}
	if err := c.conn.SetWriteDeadline(time.Now().Add(WriteTimeout)); err != nil {
		c.fail()
		return ErrClosed
	}
	n, _, err := uc.WriteMsgUnix(line, syscall.UnixRights(fds...), nil)
	if err != nil || n != len(line) {
		// A partial line would corrupt the stream: drop the connection.
		c.fail()
		return fmt.Errorf("%w: release: %v", ErrClosed, err)
	}
	return nil
}

// Handler returns a slog.Handler that sends records at level or above to the agent.
// While the agent is unreachable, records go to fallback (when not nil). Attributes
// named KeyPodNamespace and KeyPodName fill the record's pod.
func (c *Client) Handler(level slog.Leveler, fallback slog.Handler) slog.Handler {
	if level == nil {
		level = slog.LevelInfo
	}
	return &handler{c: c, level: level, fallback: fallback}
}

type handler struct {
	c        *Client
	level    slog.Leveler
	fallback slog.Handler
	attrs    []slog.Attr // already prefixed with groups
	group    string      // "a.b." prefix of later attributes
}

func (h *handler) Enabled(ctx context.Context, l slog.Level) bool {
	if l >= h.level.Level() {
		return true
	}
	return h.fallback != nil && h.fallback.Enabled(ctx, l)
}

func (h *handler) Handle(ctx context.Context, r slog.Record) error {
	if r.Level < h.level.Level() || !h.c.Connected() {
		if h.fallback != nil && h.fallback.Enabled(ctx, r.Level) {
			return h.fallback.Handle(ctx, r)
		}
		return nil
	}
	rec := &LogRecord{Time: r.Time, Level: r.Level.String(), Msg: r.Message}
	add := func(a slog.Attr, prefix string) {
		addAttr(rec, a, prefix)
	}
	for _, a := range h.attrs {
		add(a, "")
	}
	r.Attrs(func(a slog.Attr) bool {
		add(a, h.group)
		return true
	})
	if err := h.c.send(&Message{Kind: KindLog, Log: rec}); err != nil && h.fallback != nil {
		return h.fallback.Handle(ctx, r)
	}
	return nil
}

func addAttr(rec *LogRecord, a slog.Attr, prefix string) {
	v := a.Value.Resolve()
	if a.Key == "" && v.Kind() != slog.KindGroup {
		return
	}
	if v.Kind() == slog.KindGroup {
		p := prefix
		if a.Key != "" {
			p = prefix + a.Key + "."
		}
		for _, g := range v.Group() {
			addAttr(rec, g, p)
		}
		return
	}
	key := prefix + a.Key
	switch key {
	case KeyPodNamespace:
		rec.Pod.Namespace = v.String()
		return
	case KeyPodName:
		rec.Pod.Name = v.String()
		return
	}
	if rec.Attrs == nil {
		rec.Attrs = map[string]any{}
	}
	rec.Attrs[key] = jsonValue(v)
}

func jsonValue(v slog.Value) any {
	switch v.Kind() {
	case slog.KindString:
		return v.String()
	case slog.KindInt64:
		return v.Int64()
	case slog.KindUint64:
		return v.Uint64()
	case slog.KindFloat64:
		return v.Float64()
	case slog.KindBool:
		return v.Bool()
	case slog.KindDuration:
		return v.Duration().String()
	case slog.KindTime:
		return v.Time()
	}
	switch x := v.Any().(type) {
	case error:
		return x.Error()
	case fmt.Stringer:
		return x.String()
	case json.Marshaler:
		return x
	}
	return fmt.Sprint(v.Any())
}

func (h *handler) WithAttrs(attrs []slog.Attr) slog.Handler {
	h2 := *h
	h2.attrs = append([]slog.Attr(nil), h.attrs...)
	for _, a := range attrs {
		if h.group != "" {
			a.Key = h.group + a.Key
		}
		h2.attrs = append(h2.attrs, a)
	}
	if h.fallback != nil {
		h2.fallback = h.fallback.WithAttrs(attrs)
	}
	return &h2
}

func (h *handler) WithGroup(name string) slog.Handler {
	if name == "" {
		return h
	}
	h2 := *h
	h2.group = h.group + name + "."
	if h.fallback != nil {
		h2.fallback = h.fallback.WithGroup(name)
	}
	return &h2
}
