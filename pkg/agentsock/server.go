package agentsock

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// MaxLine is the longest line the server reads; a longer one closes the connection.
// The plugin's lines are a log record, a command result, a pod request or a release:
// a few hundred bytes. With DefaultMaxConns connections this bounds the read buffers
// at 16 MiB.
const MaxLine = 32 << 10

// Server is the agent's side of the socket.
type Server struct {
	// Path of the socket (Path(runDir)).
	Path string
	// OnLog and OnCommand receive the plugin's messages; nil drops them.
	OnLog     func(*LogRecord)
	OnCommand func(*CommandResult)
	// OnRequest answers requests; nil, or ErrUnsupported, answers "unsupported".
	OnRequest func(ctx context.Context, req *Request) (json.RawMessage, error)
	// Logger for connection errors (default slog.Default()).
	Logger *slog.Logger
	// Linger is how long released descriptors are kept after their connection ends
	// (0: DefaultLinger; negative: closed at once). See lingerer.
	Linger time.Duration
	// MaxConns bounds the connections served at once (0: DefaultMaxConns); past it a
	// new connection is closed at once (the plugin then works without the agent).
	MaxConns int
	// IdleTimeout closes a connection that sends nothing for this long (0:
	// DefaultIdleTimeout); a response not written within ResponseTimeout closes it too.
	IdleTimeout time.Duration
	// MaxHeld bounds the released descriptors held across all connections (0:
	// DefaultMaxHeld); past it, a released descriptor is closed at once.
	MaxHeld int

	lingerOnce sync.Once
	lingering  *lingerer
	held       atomic.Int64
}

// Defaults of Server.MaxConns and Server.IdleTimeout, and the bound on writing one
// response. A plugin holds its connection for one CNI command: at most api_timeout
// (≤ 5 min) plus the rules' work.
const (
	DefaultMaxHeld     = 1024
	DefaultMaxConns    = 512
	DefaultIdleTimeout = 10 * time.Minute
	ResponseTimeout    = 5 * time.Second
)

// DefaultLinger is Server.Linger's default: far longer than an RCU grace period
// (milliseconds; docs/performance.md), short enough to hold few sockets.
const DefaultLinger = time.Second

// MaxLingering bounds the descriptors kept after their connections ended; past it,
// they are closed at once.
const MaxLingering = 4096

// lingerer closes released descriptors some time after their connection ended, not at
// once. Why: the last close of an nfnetlink socket, while the kernel still has
// nftables objects to free after an RCU grace period (anyone's: the list is global),
// waits for that grace period holding the nftables commit lock of the socket's
// network namespace, the pod's. Closed as soon as the plugin's ADD ends, the
// sockets of that ADD would make a DEL in the same pod right after it (a sandbox torn
// down at once, or a benchmark) wait out the rest of the ADD's grace period in its
// delete batch. A second later the grace period is over and the close costs nothing.
type lingerer struct {
	mu     sync.Mutex
	n      int
	timers map[*time.Timer][]int
}

// add closes fds after d (at once when d < 0 or past MaxLingering).
func (l *lingerer) add(fds []int, d time.Duration) {
	if len(fds) == 0 {
		return
	}
	l.mu.Lock()
	if d < 0 || l.n+len(fds) > MaxLingering {
		l.mu.Unlock()
		closeFDs(fds)
		return
	}
	if l.timers == nil {
		l.timers = map[*time.Timer][]int{}
	}
	l.n += len(fds)
	var t *time.Timer
	t = time.AfterFunc(d, func() {
		l.mu.Lock()
		fds, ok := l.timers[t]
		delete(l.timers, t)
		l.n -= len(fds)
		l.mu.Unlock()
		if ok {
			closeFDs(fds)
		}
	})
	l.timers[t] = fds
	l.mu.Unlock()
}

// closeAll closes every lingering descriptor now (the server stops).
func (l *lingerer) closeAll() {
	l.mu.Lock()
	var all []int
	for t, fds := range l.timers {
		t.Stop()
		all = append(all, fds...)
	}
	l.timers, l.n = nil, 0
	l.mu.Unlock()
	closeFDs(all)
}

func closeFDs(fds []int) {
	for _, fd := range fds {
		syscall.Close(fd)
	}
}

func (s *Server) linger() *lingerer {
	s.lingerOnce.Do(func() { s.lingering = &lingerer{} })
	return s.lingering
}

func (s *Server) lingerFor() time.Duration {
	if s.Linger == 0 {
		return DefaultLinger
	}
	return s.Linger
}

// ErrUnsupported answers a request type the agent does not know.
var ErrUnsupported = errors.New("unsupported request type")

// Listen creates the socket at path with mode 0600, replacing a stale one atomically:
// it binds under a private (0700) directory next to path, sets the mode, and renames
// the socket into place, so no client can ever connect through wider permissions,
// whatever the process's umask (bind gives a socket 0777 less the umask).
func Listen(path string) (*net.UnixListener, error) {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("agent socket directory: %w", err)
	}
	if err := secureDir(dir); err != nil {
		return nil, err
	}
	priv, err := os.MkdirTemp(dir, "."+SocketName+"-")
	if err != nil {
		return nil, fmt.Errorf("agent socket directory: %w", err)
	}
	defer os.RemoveAll(priv) // empty once the socket is in place
	tmp := filepath.Join(priv, SocketName)
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: tmp, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("listen on agent socket: %w", err)
	}
	l.SetUnlinkOnClose(false)
	if err := os.Chmod(tmp, 0o600); err != nil {
		l.Close()
		return nil, fmt.Errorf("chmod agent socket: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		l.Close()
		return nil, fmt.Errorf("place agent socket: %w", err)
	}
	return l, nil
}

// secureDir makes the socket's directory what the plugin's Dial trusts: a real
// directory, the agent's own, writable by nobody else (a directory made 0777 by
// someone else is taken back).
func secureDir(dir string) error {
	fi, err := os.Lstat(dir)
	if err != nil {
		return fmt.Errorf("agent socket directory: %w", err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("agent socket directory %s is not a directory (%s)", dir, fi.Mode().Type())
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok && (int(st.Uid) != os.Geteuid() || int(st.Gid) != os.Getegid()) {
		if err := os.Chown(dir, os.Geteuid(), os.Getegid()); err != nil {
			return fmt.Errorf("agent socket directory: take ownership: %w", err)
		}
	}
	if fi.Mode().Perm()&0o022 != 0 {
		if err := os.Chmod(dir, fi.Mode().Perm()&^0o022); err != nil {
			return fmt.Errorf("agent socket directory: %w", err)
		}
	}
	return nil
}

func inodeOf(path string) uint64 {
	fi, err := os.Lstat(path)
	if err != nil {
		return 0
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return st.Ino
	}
	return 0
}

// Serve listens on s.Path and serves connections until ctx ends, then removes the
// socket (unless another agent replaced it meanwhile).
func (s *Server) Serve(ctx context.Context) error {
	l, err := Listen(s.Path)
	if err != nil {
		return err
	}
	return s.ServeListener(ctx, l)
}

// ServeListener serves on l (made by Listen at s.Path) until ctx ends.
func (s *Server) ServeListener(ctx context.Context, l *net.UnixListener) error {
	log := s.Logger
	if log == nil {
		log = slog.Default()
	}
	ino := inodeOf(s.Path)
	var wg sync.WaitGroup
	conns := map[net.Conn]struct{}{}
	var mu sync.Mutex
	stop := context.AfterFunc(ctx, func() {
		l.Close()
		mu.Lock()
		for c := range conns {
			c.Close()
		}
		mu.Unlock()
	})
	defer stop()
	defer func() {
		if ino != 0 && inodeOf(s.Path) == ino {
			if err := os.Remove(s.Path); err != nil && !errors.Is(err, fs.ErrNotExist) {
				log.Warn("remove agent socket", "path", s.Path, "err", err)
			}
		}
	}()
	maxConns := s.MaxConns
	if maxConns <= 0 {
		maxConns = DefaultMaxConns
	}
	var lastFullLog time.Time
	backoff := time.Duration(0)
	for {
		conn, err := l.Accept()
		if err != nil && ctx.Err() == nil && outOfResources(err) {
			// The agent holds descriptors for its connections: running out of them (or
			// of memory) must not stop the agent; retry as connections end.
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			log.Warn("agent socket: accept, retrying", "path", s.Path, "err", err, "in", backoff)
			select {
			case <-time.After(backoff):
			case <-ctx.Done():
			}
			continue
		}
		backoff = 0
		if err != nil {
			mu.Lock()
			for c := range conns {
				c.Close()
			}
			mu.Unlock()
			wg.Wait()
			s.linger().closeAll() // every connection has ended: no descriptor is added after
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("accept on agent socket: %w", err)
		}
		mu.Lock()
		full := len(conns) >= maxConns
		if !full {
			conns[conn] = struct{}{}
		}
		mu.Unlock()
		if full {
			conn.Close()
			if time.Since(lastFullLog) > time.Minute {
				lastFullLog = time.Now()
				log.Warn("agent socket: too many connections, refusing new ones until some end", "max", maxConns)
			}
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			s.serveConn(ctx, conn, log)
			mu.Lock()
			delete(conns, conn)
			mu.Unlock()
			conn.Close()
		}()
	}
}

// outOfResources reports whether an accept failed for want of descriptors or memory,
// which passes.
func outOfResources(err error) bool {
	for _, e := range []syscall.Errno{syscall.EMFILE, syscall.ENFILE, syscall.ENOBUFS, syscall.ENOMEM} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// MaxHeldFDs bounds the descriptors the agent holds for one connection; past it, a
// released descriptor is closed at once. It is also the most one read takes from a
// message (the kernel closes any beyond).
const MaxHeldFDs = 64

// fdHolder reads a unix connection and keeps the file descriptors that arrive with the
// data (a "release" message's SCM_RIGHTS) until the connection ends, then closes them:
// the plugin closes its own copies before it closes the connection, so the agent's
// close is the last one, and any wait the kernel attaches to it happens here.
type fdHolder struct {
	c     *net.UnixConn
	oob   []byte
	held  []int
	log   *slog.Logger
	idle  time.Duration
	total *atomic.Int64 // held by every connection of the server
	max   int64         // bound of total
}

func (r *fdHolder) Read(p []byte) (int, error) {
	_ = r.c.SetReadDeadline(time.Now().Add(r.idle))
	n, oobn, _, _, err := r.c.ReadMsgUnix(p, r.oob)
	if oobn > 0 {
		msgs, perr := syscall.ParseSocketControlMessage(r.oob[:oobn])
		if perr != nil {
			r.log.Warn("agent socket: unreadable control message", "err", perr)
		}
		for _, m := range msgs {
			fds, err := syscall.ParseUnixRights(&m)
			if err != nil {
				continue
			}
			for _, fd := range fds {
				if len(r.held) < MaxHeldFDs && r.total.Add(1) <= r.max {
					r.held = append(r.held, fd)
					continue
				} else if len(r.held) < MaxHeldFDs {
					r.total.Add(-1)
				}
				syscall.Close(fd)
			}
		}
	}
	switch {
	case errors.Is(err, io.EOF), err == nil && n == 0 && oobn == 0:
		return n, io.EOF // the plain end of the stream, as bufio.Scanner expects it
	}
	return n, err
}

// take returns the held descriptors and forgets them (the connection has ended).
func (r *fdHolder) take() []int {
	fds := r.held
	r.held = nil
	r.total.Add(-int64(len(fds)))
	return fds
}

func (s *Server) serveConn(ctx context.Context, conn net.Conn, log *slog.Logger) {
	var rd io.Reader = conn
	idle := s.IdleTimeout
	if idle <= 0 {
		idle = DefaultIdleTimeout
	}
	if uc, ok := conn.(*net.UnixConn); ok {
		maxHeld := int64(s.MaxHeld)
		if maxHeld <= 0 {
			maxHeld = DefaultMaxHeld
		}
		h := &fdHolder{c: uc, oob: make([]byte, syscall.CmsgSpace(MaxHeldFDs*4)), log: log, idle: idle, total: &s.held, max: maxHeld}
		defer func() { s.linger().add(h.take(), s.lingerFor()) }()
		rd = h
	}
	sc := bufio.NewScanner(rd)
	sc.Buffer(make([]byte, 0, 4096), MaxLine)
	w := bufio.NewWriter(conn)
	for sc.Scan() {
		var m Message
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			log.Warn("agent socket: malformed message, closing the connection", "err", err)
			return
		}
		switch {
		case m.Kind == KindLog && m.Log != nil:
			if s.OnLog != nil {
				s.OnLog(m.Log)
			}
		case m.Kind == KindCommand && m.Cmd != nil:
			if s.OnCommand != nil {
				s.OnCommand(m.Cmd)
			}
		case m.Kind == KindRelease:
			// Its descriptors are held until the connection ends (fdHolder).
		case m.Kind == KindRequest && m.Req != nil:
			resp := &Response{}
			var body json.RawMessage
			err := ErrUnsupported
			if s.OnRequest != nil {
				body, err = s.OnRequest(ctx, m.Req)
			}
			if err != nil {
				resp.Error = err.Error()
			} else {
				resp.Body = body
			}
			line, err := json.Marshal(&Message{V: Version, Kind: KindResponse, ID: m.ID, Resp: resp})
			if err != nil {
				log.Warn("agent socket: encode response", "err", err)
				return
			}
			_ = conn.SetWriteDeadline(time.Now().Add(ResponseTimeout))
			w.Write(append(line, '\n'))
			if err := w.Flush(); err != nil {
				return
			}
		default:
			log.Debug("agent socket: ignored message", "kind", m.Kind, "v", m.V)
		}
	}
	switch err := sc.Err(); {
	case err == nil, ctx.Err() != nil, errors.Is(err, net.ErrClosed):
	case errors.Is(err, os.ErrDeadlineExceeded):
		log.Warn("agent socket: closing a connection idle for too long", "idle", idle)
	default:
		log.Warn("agent socket: read", "err", err)
	}
}
