package agentsock

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"os"
	"strconv"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Timeouts of the client. A CNI ADD never waits longer than this on the agent.
// Dial meets DialTimeout without a timer: a connect to a unix stream socket on Linux
// does not wait at all (no listener: ECONNREFUSED or ENOENT; a full backlog: EAGAIN,
// which net does not wait on either).
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

// Dial connects to the agent's socket in runDir, failing at once when no agent listens
// there. net.DialUnix rather than a net.Dialer with a timeout: the same connect, minus
// the deadline context and timer (and half the allocations) in the plugin's run.
//
// Only an agent running as root is trusted: the run directory must be a directory
// owned by root and writable by nobody else, and the process listening on the socket
// must be root (SO_PEERCRED). Anything else fails with ErrUntrusted — whoever could
// put a socket there could otherwise answer "not meshed" for every pod — and the
// plugin goes to the API server instead. (The client's own effective UID is trusted
// too, so tests can run unprivileged; the plugin runs as root.)
func Dial(runDir string) (*Client, error) {
	if err := checkRunDir(runDir); err != nil {
		return nil, err
	}
	conn, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: Path(runDir), Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("agentsock: dial: %w", err)
	}
	if err := checkPeer(conn); err != nil {
		conn.Close()
		return nil, err
	}
	return &Client{conn: conn}, nil
}

// ErrUntrusted: the agent socket, its directory or the process behind it is not
// root's; the plugin does not talk to it.
var ErrUntrusted = errors.New("agentsock: untrusted agent socket")

func trustedUID(uid uint32) bool { return uid == 0 || int(uid) == os.Geteuid() }

// checkRunDir refuses a run directory that is not a directory (a symlink is not
// followed), is owned by another user, or is writable by group or others.
func checkRunDir(dir string) error {
	var st unix.Stat_t
	if err := unix.Lstat(dir, &st); err != nil {
		return fmt.Errorf("agentsock: run directory %s: %w", dir, err)
	}
	switch {
	case st.Mode&unix.S_IFMT != unix.S_IFDIR:
		return fmt.Errorf("%w: %s is not a directory", ErrUntrusted, dir)
	case !trustedUID(st.Uid):
		return fmt.Errorf("%w: %s is owned by uid %d, not root", ErrUntrusted, dir, st.Uid)
	case st.Mode&0o022 != 0:
		return fmt.Errorf("%w: %s is writable by group or others (mode %o)", ErrUntrusted, dir, st.Mode&0o7777)
	}
	return nil
}

// checkPeer refuses a socket whose listening process is not root.
func checkPeer(conn *net.UnixConn) error {
	raw, err := conn.SyscallConn()
	if err != nil {
		return fmt.Errorf("agentsock: peer credentials: %w", err)
	}
	var cred *unix.Ucred
	var serr error
	if err := raw.Control(func(fd uintptr) {
		cred, serr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return fmt.Errorf("agentsock: peer credentials: %w", err)
	}
	if serr != nil {
		return fmt.Errorf("agentsock: peer credentials: %w", serr)
	}
	if !trustedUID(cred.Uid) {
		return fmt.Errorf("%w: the process listening on it (pid %d) runs as uid %d, not root", ErrUntrusted, cred.Pid, cred.Uid)
	}
	return nil
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
	if err := c.sendRaw(line, nil); err != nil {
		// A partial line would corrupt the stream: drop the connection.
		c.fail()
		return fmt.Errorf("%w: %v", ErrClosed, err)
	}
	return nil
}

// sendRaw writes b (with the control message oob, if any) whole. It first tries once
// without waiting, so a deadline cannot expire before the first attempt however late
// this goroutine is scheduled on a loaded node; only when the agent is not reading
// (the socket's buffer is full) does it wait, at most WriteTimeout, for the rest.
func (c *Client) sendRaw(b, oob []byte) error {
	uc, ok := c.conn.(*net.UnixConn)
	if !ok {
		return errors.New("not a unix connection")
	}
	rc, err := uc.SyscallConn()
	if err != nil {
		return err
	}
	n, serr := 0, error(nil)
	if err := rc.Control(func(fd uintptr) {
		n, serr = unix.SendmsgN(int(fd), b, oob, nil, unix.MSG_DONTWAIT|unix.MSG_NOSIGNAL)
	}); err != nil {
		return err
	}
	switch {
	case serr == nil && n == len(b):
		return nil
	case serr != nil && !errors.Is(serr, unix.EAGAIN):
		return serr
	case serr != nil:
		n = 0 // nothing sent: the control message goes with the rest
	default:
		oob = nil // sent with the first bytes
	}
	if err := uc.SetWriteDeadline(time.Now().Add(WriteTimeout)); err != nil {
		return err
	}
	m, _, err := uc.WriteMsgUnix(b[n:], oob, nil)
	if err == nil && m != len(b)-n {
		err = io.ErrShortWrite
	}
	return err
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
	return c.Report(r)
}

// Report sends a command result built by the caller (ReportCommand's fields plus
// ContainerID and EBPF).
func (c *Client) Report(r *CommandResult) error {
	if c == nil {
		return ErrClosed
	}
	line := appendCommandLine(make([]byte, 0, 256), r)
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.writeLocked(line)
}

// appendCommandLine appends the line of a "cmd" message carrying r: the bytes
// json.Marshal(&Message{V: Version, Kind: KindCommand, Cmd: r}) and a newline,
// written without encoding/json's reflection, which in the plugin's fresh process
// would build the encoders of Message's types at every start for the one
// message every CNI command sends.
func appendCommandLine(b []byte, r *CommandResult) []byte {
	b = append(b, `{"v":`...)
	b = strconv.AppendInt(b, Version, 10)
	b = append(b, `,"kind":"`+KindCommand+`","cmd":{"command":`...)
	b = appendJSONString(b, r.Command)
	b = append(b, `,"result":`...)
	b = appendJSONString(b, r.Result)
	b = append(b, `,"duration_seconds":`...)
	b = appendJSONFloat(b, r.Seconds)
	b = append(b, `,"pod":{`...)
	if r.Pod.Namespace != "" {
		b = append(b, `"namespace":`...)
		b = appendJSONString(b, r.Pod.Namespace)
	}
	if r.Pod.Name != "" {
		if r.Pod.Namespace != "" {
			b = append(b, ',')
		}
		b = append(b, `"name":`...)
		b = appendJSONString(b, r.Pod.Name)
	}
	b = append(b, '}')
	if r.ErrorMsg != "" {
		b = append(b, `,"error":`...)
		b = appendJSONString(b, r.ErrorMsg)
	}
	if r.ContainerID != "" {
		b = append(b, `,"container_id":`...)
		b = appendJSONString(b, r.ContainerID)
	}
	if e := r.EBPF; e != nil {
		b = append(b, `,"ebpf":{"netns_cookie":`...)
		b = strconv.AppendUint(b, e.NetnsCookie, 10)
		if e.Mode != "" {
			b = append(b, `,"mode":`...)
			b = appendJSONString(b, e.Mode)
		}
		b = append(b, `,"proxy_uid":`...)
		b = strconv.AppendUint(b, uint64(e.ProxyUID), 10)
		if e.PodUID != "" {
			b = append(b, `,"pod_uid":`...)
			b = appendJSONString(b, e.PodUID)
		}
		b = append(b, '}')
	}
	return append(b, "}}\n"...)
}

// appendJSONString appends s as encoding/json writes it. Printable ASCII other than
// the characters json escapes (", \\, and the HTML-sensitive <, >, &) is copied;
// any other string is left to encoding/json, whose string encoder needs no reflection
// over struct types.
func appendJSONString(b []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c > 0x7e || c == '"' || c == '\\' || c == '<' || c == '>' || c == '&' {
			q, err := json.Marshal(s)
			if err != nil { // cannot happen: every string encodes
				return append(b, `""`...)
			}
			return append(b, q...)
		}
	}
	b = append(b, '"')
	b = append(b, s...)
	return append(b, '"')
}

// appendJSONFloat appends f as encoding/json writes a float64 (ES6 number format).
// f must be finite (a duration's seconds always are).
func appendJSONFloat(b []byte, f float64) []byte {
	format := byte('f')
	if a := math.Abs(f); a != 0 && (a < 1e-6 || a >= 1e21) {
		format = 'e'
	}
	b = strconv.AppendFloat(b, f, format, -1, 64)
	if format == 'e' {
		// clean up e-09 to e-9
		if n := len(b); n >= 4 && b[n-4] == 'e' && b[n-3] == '-' && b[n-2] == '0' {
			b[n-2] = b[n-1]
			b = b[:n-1]
		}
	}
	return b
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
	if c.r == nil {
		c.r = bufio.NewReader(c.conn) // only requests read: most commands never do
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

// EBPF asks the agent whether the network namespace with this cookie is
// accelerated. An error means the agent could not be asked.
func (c *Client) EBPF(ctx context.Context, cookie uint64) (*EBPFResponse, error) {
	var resp EBPFResponse
	if err := c.Call(ctx, RequestEBPF, EBPFRequest{NetnsCookie: cookie}, &resp); err != nil {
		return nil, err
	}
	return &resp, nil
}

// releaseLine is json.Marshal(&Message{V: Version, Kind: KindRelease}) and a newline
// (a test checks it), a constant so that Release needs no encoding/json.
const releaseLine = `{"v":1,"kind":"` + KindRelease + `"}` + "\n"

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
	if _, ok := c.conn.(*net.UnixConn); !ok || len(fds) == 0 {
		return ErrClosed
	}
	line := []byte(releaseLine)
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.broken {
		return ErrClosed
	}
	if err := c.sendRaw(line, syscall.UnixRights(fds...)); err != nil {
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
	h := &handler{c: c, level: level}
	if fallback != nil {
		h.fallback = &lazyHandler{root: fallback}
	}
	return h
}

type handler struct {
	c        *Client
	level    slog.Leveler
	fallback *lazyHandler
	attrs    []slog.Attr // already prefixed with groups
	group    string      // "a.b." prefix of later attributes
}

// lazyHandler is the fallback handler with the handler's WithAttrs and WithGroup
// applied only when a record first goes to it: the plugin adds its attributes to every
// logger, and a slog.TextHandler formats them at once, but most runs log nothing or
// only to the agent.
type lazyHandler struct {
	root   slog.Handler // the fallback given to Handler
	parent *lazyHandler // nil at the root
	attrs  []slog.Attr  // WithAttrs(attrs), when group is ""
	group  string       // WithGroup(group)
	once   sync.Once
	h      slog.Handler
}

func (l *lazyHandler) get() slog.Handler {
	l.once.Do(func() {
		switch {
		case l.parent == nil:
			l.h = l.root
		case l.group != "":
			l.h = l.parent.get().WithGroup(l.group)
		default:
			l.h = l.parent.get().WithAttrs(l.attrs)
		}
	})
	return l.h
}

// enabled asks the root first, so that a level the fallback does not log derives
// nothing (slog's handlers share their level with the handlers they derive).
func (l *lazyHandler) enabled(ctx context.Context, lv slog.Level) bool {
	return l != nil && l.root.Enabled(ctx, lv) && l.get().Enabled(ctx, lv)
}

func (h *handler) Enabled(ctx context.Context, l slog.Level) bool {
	if l >= h.level.Level() {
		return true
	}
	return h.fallback.enabled(ctx, l)
}

func (h *handler) Handle(ctx context.Context, r slog.Record) error {
	if r.Level < h.level.Level() || !h.c.Connected() {
		if h.fallback.enabled(ctx, r.Level) {
			return h.fallback.get().Handle(ctx, r)
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
		return h.fallback.get().Handle(ctx, r)
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
	h2.attrs = make([]slog.Attr, len(h.attrs), len(h.attrs)+len(attrs))
	copy(h2.attrs, h.attrs)
	for _, a := range attrs {
		if h.group != "" {
			a.Key = h.group + a.Key
		}
		h2.attrs = append(h2.attrs, a)
	}
	if h.fallback != nil {
		// Values are resolved now, as slog's handlers do in WithAttrs.
		fa := make([]slog.Attr, len(attrs))
		for i, a := range attrs {
			a.Value = a.Value.Resolve()
			fa[i] = a
		}
		h2.fallback = &lazyHandler{root: h.fallback.root, parent: h.fallback, attrs: fa}
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
		h2.fallback = &lazyHandler{root: h.fallback.root, parent: h.fallback, group: name}
	}
	return &h2
}
