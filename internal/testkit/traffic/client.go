package traffic

import (
	"encoding/json"
	"io"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/meshcni/meshcni/internal/standin/proxysim"
)

// DialOptions configures Dial.
type DialOptions struct {
	Cred    Cred           // the client's identity (zero value: root)
	Source  netip.AddrPort // optional local address to bind
	Send    string         // optional payload
	Timeout time.Duration  // bound on the probe (default 3s); the child is killed 5s later
}

// Answer is what a client got back.
type Answer struct {
	proxysim.ProbeResult
	// Proxy is set when a record-mode proxysim answered: which listener, and the
	// original destination it recovered.
	Proxy *proxysim.Record
	// App is set when an App answered (directly or through a forwarding proxy).
	App *AppReply
}

// Listener is the proxysim listener that answered ("" when none did).
func (a Answer) Listener() string {
	if a.Proxy == nil {
		return ""
	}
	return a.Proxy.Listener
}

// OrigDst is the original destination the proxy recovered (zero when none).
func (a Answer) OrigDst() netip.AddrPort {
	if a.Proxy == nil {
		return netip.AddrPort{}
	}
	return a.Proxy.OrigDst
}

// Dial connects from inside the namespace to dst as opts.Cred (a child process, so the
// socket really belongs to that UID) and decodes whatever answered. Connection errors
// are in Answer.Error; only a broken helper fails the test.
func Dial(t testing.TB, nsPath string, dst netip.AddrPort, opts DialOptions) Answer {
	t.Helper()
	if opts.Timeout <= 0 {
		opts.Timeout = 3 * time.Second
	}
	args := []string{"client", "--connect", dst.String(), "--timeout", opts.Timeout.String()}
	if opts.Source.IsValid() {
		args = append(args, "--source", opts.Source.String())
	}
	if opts.Send != "" {
		args = append(args, "--send", opts.Send)
	}
	out, err := RunInNetns(nsPath, opts.Cred, opts.Timeout+5*time.Second, ProxysimBinary(t), args...)
	if err != nil {
		t.Fatalf("client: %v", err)
	}
	var a Answer
	if err := json.Unmarshal(out, &a.ProbeResult); err != nil {
		t.Fatalf("client output %q: %v", out, err)
	}
	line := strings.TrimSpace(a.Reply)
	if i := strings.IndexByte(line, '\n'); i >= 0 {
		line = line[:i]
	}
	var probe struct {
		Event  string `json:"event"`
		Server string `json:"server"`
	}
	if json.Unmarshal([]byte(line), &probe) == nil {
		switch {
		case probe.Event == proxysim.EventConn:
			var r proxysim.Record
			if json.Unmarshal([]byte(line), &r) == nil {
				a.Proxy = &r
			}
		case probe.Server != "":
			var r AppReply
			if json.Unmarshal([]byte(line), &r) == nil {
				a.App = &r
			}
		}
	}
	return a
}

// DNSOptions configures QueryDNS.
type DNSOptions struct {
	Cred    Cred
	AAAA    bool
	TCP     bool
	Timeout time.Duration // default 3s
}

// QueryDNS sends one query for name to server from inside the namespace as opts.Cred.
func QueryDNS(t testing.TB, nsPath string, server netip.AddrPort, name string, opts DNSOptions) proxysim.DNSResult {
	t.Helper()
	if opts.Timeout <= 0 {
		opts.Timeout = 3 * time.Second
	}
	args := []string{"dns-client", "--server", server.String(), "--name", name, "--timeout", opts.Timeout.String()}
	if opts.AAAA {
		args = append(args, "--type", "AAAA")
	}
	if opts.TCP {
		args = append(args, "--tcp")
	}
	out, err := RunInNetns(nsPath, opts.Cred, opts.Timeout+5*time.Second, ProxysimBinary(t), args...)
	if err != nil {
		t.Fatalf("dns-client: %v", err)
	}
	var r proxysim.DNSResult
	if err := json.Unmarshal(out, &r); err != nil {
		t.Fatalf("dns-client output %q: %v", out, err)
	}
	return r
}

// SendBulk connects from inside the namespace to dst (from this process, as root),
// sends n zero bytes, closes its sending side and decodes the answer of the
// record-mode proxy that the redirect took the connection to (which listener, the
// original destination it read). Any error fails the test.
func SendBulk(t testing.TB, nsPath string, dst netip.AddrPort, n int) proxysim.Record {
	t.Helper()
	var c net.Conn
	if err := InNetns(nsPath, func() (err error) {
		c, err = net.DialTimeout("tcp", dst.String(), 5*time.Second)
		return err
	}); err != nil {
		t.Fatalf("dial %v in %s: %v", dst, nsPath, err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(20 * time.Second))
	if _, err := c.Write(make([]byte, n)); err != nil {
		t.Fatalf("send %d bytes to %v: %v", n, dst, err)
	}
	_ = c.(*net.TCPConn).CloseWrite()
	b, err := io.ReadAll(c)
	if err != nil {
		t.Fatalf("read the proxy's answer: %v", err)
	}
	var rec proxysim.Record
	if err := json.Unmarshal(b, &rec); err != nil {
		t.Fatalf("proxy's answer %q: %v", b, err)
	}
	return rec
}
