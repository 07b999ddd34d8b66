package traffic

import (
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"
)

// AppReply is what an App answers each connection with (one JSON line).
type AppReply struct {
	Server string         `json:"server"`
	Peer   netip.AddrPort `json:"peer"`
	Local  netip.AddrPort `json:"local"`
}

// App is an in-process TCP server whose socket lives in a namespace. It answers every
// connection with an AppReply naming itself and the peer address it saw, then closes.
type App struct {
	Name string
	Addr netip.AddrPort // bound address (the real port when asked for 0)
	ln   *net.TCPListener
}

// StartApp listens on addr inside the namespace (use [::] for both families) and
// serves until the test ends.
func StartApp(t testing.TB, nsPath string, addr netip.AddrPort, name string) *App {
	t.Helper()
	var ln net.Listener
	err := InNetns(nsPath, func() error {
		var err error
		ln, err = net.Listen("tcp", addr.String())
		return err
	})
	if err != nil {
		t.Fatalf("app %s listen on %v: %v", name, addr, err)
	}
	a := &App{Name: name, ln: ln.(*net.TCPListener)}
	a.Addr = unmap(a.ln.Addr().(*net.TCPAddr).AddrPort())
	t.Cleanup(func() { _ = a.ln.Close() })
	go a.serve()
	return a
}

func unmap(ap netip.AddrPort) netip.AddrPort {
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
}

func (a *App) serve() {
	for {
		c, err := a.ln.AcceptTCP()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		go func() {
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(10 * time.Second))
			r := AppReply{
				Server: a.Name,
				Peer:   unmap(c.RemoteAddr().(*net.TCPAddr).AddrPort()),
				Local:  unmap(c.LocalAddr().(*net.TCPAddr).AddrPort()),
			}
			b, _ := json.Marshal(r)
			if _, err := c.Write(append(b, '\n')); err != nil {
				return
			}
			_ = c.CloseWrite()
			_, _ = io.Copy(io.Discard, io.LimitReader(c, 1<<20))
		}()
	}
}
