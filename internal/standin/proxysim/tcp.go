package proxysim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync"
	"time"

	"github.com/meshcni/meshcni/pkg/origdst"
)

func (p *Proxy) acceptLoop(ctx context.Context, l *tcpListener) error {
	var delay time.Duration
	for {
		c, err := l.ln.AcceptTCP()
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return nil
			}
			// Temporary failures (EMFILE...): back off like net/http does.
			delay = min(max(2*delay, 5*time.Millisecond), time.Second)
			p.log.Warn("accept failed", "listener", l.name, "err", err, "retry_in", delay)
			select {
			case <-time.After(delay):
				continue
			case <-ctx.Done():
				return nil
			}
		}
		delay = 0
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			p.handleConn(ctx, l, c)
		}()
	}
}

func unmapped(ap netip.AddrPort) netip.AddrPort {
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
}

func tcpAddrPort(a net.Addr) netip.AddrPort {
	if ta, ok := a.(*net.TCPAddr); ok && ta != nil {
		return unmapped(ta.AddrPort())
	}
	return netip.AddrPort{}
}

func (p *Proxy) handleConn(ctx context.Context, l *tcpListener, c *net.TCPConn) {
	defer c.Close()
	// Shutting down closes in-flight connections so Serve never waits on a client.
	stop := context.AfterFunc(ctx, func() { _ = c.Close() })
	defer stop()
	rec := Record{
		Event:    EventConn,
		Listener: l.name,
		Proto:    "tcp",
		Peer:     tcpAddrPort(c.RemoteAddr()),
		Local:    tcpAddrPort(c.LocalAddr()),
		Time:     time.Now().UTC(),
	}
	dst, err := origdst.Of(c, l.tproxy)
	if err != nil {
		rec.OrigDstErr = err.Error()
	} else {
		rec.OrigDst = dst
	}

	if p.cfg.Mode == ModeRecord {
		rec = p.emit(rec)
		p.log.Info("connection", "listener", rec.Listener, "peer", rec.Peer, "orig_dst", rec.OrigDst, "mode", p.cfg.Mode)
		_ = c.SetWriteDeadline(time.Now().Add(p.cfg.IdleTimeout))
		b, _ := json.Marshal(rec)
		if _, err := c.Write(append(b, '\n')); err != nil {
			p.log.Warn("write record", "peer", rec.Peer, "err", err)
			return
		}
		// Half-close and drain what the client sent, so closing with unread data does
		// not reset the connection before the client has read the record.
		_ = c.CloseWrite()
		_ = c.SetReadDeadline(time.Now().Add(p.cfg.IdleTimeout))
		_, _ = io.Copy(io.Discard, io.LimitReader(c, maxReply))
		return
	}

	// ModeForward.
	start := time.Now()
	up, err := p.dialOriginal(ctx, l, rec)
	if err != nil {
		rec.ForwardErr = err.Error()
		rec.Forward = rec.OrigDst
		p.emit(rec)
		p.log.Warn("forward failed", "listener", rec.Listener, "peer", rec.Peer, "orig_dst", rec.OrigDst, "err", err)
		return
	}
	defer up.Close()
	stopUp := context.AfterFunc(ctx, func() { _ = up.Close() })
	defer stopUp()
	rec.Forward = tcpAddrPort(up.RemoteAddr())
	rec.ForwardSource = tcpAddrPort(up.LocalAddr())
	p.emit(rec)
	sent, received := splice(c, up, p.cfg.NoSplice)
	p.log.Info("connection",
		"listener", rec.Listener, "peer", rec.Peer, "orig_dst", rec.OrigDst,
		"forward_source", rec.ForwardSource, "bytes_sent", sent, "bytes_received", received,
		"duration", time.Since(start).String())
}

// dialOriginal dials the connection's original destination, refusing to dial the
// proxy's own listener (a connection that reached a capture port without a redirect
// reports its local address as the original destination: forwarding would loop).
func (p *Proxy) dialOriginal(ctx context.Context, l *tcpListener, rec Record) (*net.TCPConn, error) {
	if rec.OrigDstErr != "" {
		return nil, fmt.Errorf("no original destination: %s", rec.OrigDstErr)
	}
	if !l.tproxy && rec.OrigDst == rec.Local {
		return nil, fmt.Errorf("original destination %v is the proxy's own listener (not redirected): refusing to loop", rec.OrigDst)
	}
	d := net.Dialer{Timeout: p.cfg.DialTimeout}
	if l.name == ListenerInbound {
		src := p.cfg.InboundSourceV4
		if rec.OrigDst.Addr().Is6() {
			src = p.cfg.InboundSourceV6
		}
		if src.IsValid() {
			d.LocalAddr = net.TCPAddrFromAddrPort(netip.AddrPortFrom(src, 0))
		}
	}
	c, err := d.DialContext(ctx, "tcp", rec.OrigDst.String())
	if err != nil {
		return nil, fmt.Errorf("dial %v: %w", rec.OrigDst, err)
	}
	return c.(*net.TCPConn), nil
}

// splice copies both ways, half-closing each side when the other finishes, and returns
// the bytes sent downstream→upstream and upstream→downstream. With noSplice the
// bytes go through a user-space buffer instead of splice(2).
func splice(down, up *net.TCPConn, noSplice bool) (sent, received int64) {
	copyFn := io.Copy
	if noSplice {
		copyFn = func(dst io.Writer, src io.Reader) (int64, error) {
			// Plain wrappers hide ReadFrom/WriteTo, so io.CopyBuffer reads and writes.
			return io.CopyBuffer(struct{ io.Writer }{dst}, struct{ io.Reader }{src}, make([]byte, 64<<10))
		}
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		sent, _ = copyFn(up, down)
		_ = up.CloseWrite()
	}()
	received, _ = copyFn(down, up)
	_ = down.CloseWrite()
	wg.Wait()
	return sent, received
}
