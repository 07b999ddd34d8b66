package agentsock

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
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
