package proxysim

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strings"
	"time"

	"golang.org/x/net/dns/dnsmessage"
)

// The probe clients below back the `client` and `dns-client` subcommands of
// meshcni-proxysim: tests run them as a child process under a chosen UID, because
// owner matches (--uid-owner, meta skuid) look at the UID that created the socket.

// ProbeRequest describes one TCP probe.
type ProbeRequest struct {
	Dst     netip.AddrPort
	Source  netip.AddrPort // optional local address to bind
	Send    string         // optional payload, written before half-closing
	Timeout time.Duration  // whole probe, default 3s
}

// ProbeResult is what a TCP probe saw.
type ProbeResult struct {
	Connected bool           `json:"connected"`
	Local     netip.AddrPort `json:"local,omitzero"`
	Remote    netip.AddrPort `json:"remote,omitzero"`
	Reply     string         `json:"reply"`
	Error     string         `json:"error,omitempty"`
	UID       int            `json:"uid"`
}

const maxReply = 64 << 10

// Probe connects to req.Dst, sends req.Send, half-closes and reads the reply until EOF
// or the timeout. Failures are reported in the result, never by blocking.
func Probe(ctx context.Context, req ProbeRequest) ProbeResult {
	res := ProbeResult{UID: os.Getuid()}
	if req.Timeout <= 0 {
		req.Timeout = 3 * time.Second
	}
	ctx, cancel := context.WithTimeout(ctx, req.Timeout)
	defer cancel()
	d := net.Dialer{}
	if req.Source.IsValid() {
		d.LocalAddr = net.TCPAddrFromAddrPort(req.Source)
	}
	c, err := d.DialContext(ctx, "tcp", req.Dst.String())
	if err != nil {
		res.Error = fmt.Sprintf("dial %v: %v", req.Dst, err)
		return res
	}
	defer c.Close()
	tc := c.(*net.TCPConn)
	res.Connected = true
	res.Local, res.Remote = tcpAddrPort(tc.LocalAddr()), tcpAddrPort(tc.RemoteAddr())
	dl, _ := ctx.Deadline()
	_ = tc.SetDeadline(dl)
	if req.Send != "" {
		if _, err := io.WriteString(tc, req.Send); err != nil {
			res.Error = fmt.Sprintf("write: %v", err)
			return res
		}
	}
	_ = tc.CloseWrite()
	b, err := io.ReadAll(io.LimitReader(tc, maxReply))
	res.Reply = string(b)
	if err != nil {
		res.Error = fmt.Sprintf("read: %v", err)
	}
	return res
}

// DNSRequest describes one DNS query.
type DNSRequest struct {
	Server  netip.AddrPort
	Name    string
	Type    dnsmessage.Type // default TypeA
	TCP     bool
	Timeout time.Duration // default 3s
}

// DNSResult is the outcome of a DNS query.
type DNSResult struct {
	RCode   string       `json:"rcode,omitempty"`
	Answers []netip.Addr `json:"answers,omitempty"`
	Error   string       `json:"error,omitempty"`
	UID     int          `json:"uid"`
}

// ParseDNSType parses "A" or "AAAA".
func ParseDNSType(s string) (dnsmessage.Type, error) {
	switch s {
	case "A", "a":
		return dnsmessage.TypeA, nil
	case "AAAA", "aaaa":
		return dnsmessage.TypeAAAA, nil
	default:
		return 0, fmt.Errorf("unsupported query type %q (want A or AAAA)", s)
	}
}

// QueryDNS sends one query and decodes the answer addresses.
func QueryDNS(ctx context.Context, req DNSRequest) DNSResult {
	res := DNSResult{UID: os.Getuid()}
	if err := queryDNS(ctx, req, &res); err != nil {
		res.Error = err.Error()
	}
	return res
}

func queryDNS(ctx context.Context, req DNSRequest, res *DNSResult) error {
	if req.Timeout <= 0 {
		req.Timeout = 3 * time.Second
	}
	if req.Type == 0 {
		req.Type = dnsmessage.TypeA
	}
	name, err := dnsmessage.NewName(fqdn(req.Name))
	if err != nil {
		return fmt.Errorf("name %q: %w", req.Name, err)
	}
	id := uint16(time.Now().UnixNano())
	b := dnsmessage.NewBuilder(nil, dnsmessage.Header{ID: id, RecursionDesired: true})
	if err := b.StartQuestions(); err != nil {
		return err
	}
	if err := b.Question(dnsmessage.Question{Name: name, Type: req.Type, Class: dnsmessage.ClassINET}); err != nil {
		return err
	}
	query, err := b.Finish()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, req.Timeout)
	defer cancel()
	proto := "udp"
	if req.TCP {
		proto = "tcp"
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, proto, req.Server.String())
	if err != nil {
		return fmt.Errorf("dial %s %v: %w", proto, req.Server, err)
	}
	defer c.Close()
	dl, _ := ctx.Deadline()
	_ = c.SetDeadline(dl)
	var resp []byte
	if req.TCP {
		if err := writeFramed(c, query); err != nil {
			return fmt.Errorf("write: %w", err)
		}
		if resp, err = readFramed(c); err != nil {
			return fmt.Errorf("read: %w", err)
		}
	} else {
		if _, err := c.Write(query); err != nil {
			return fmt.Errorf("write: %w", err)
		}
		buf := make([]byte, maxDNSMessage)
		n, err := c.Read(buf)
		if err != nil {
			return fmt.Errorf("read: %w", err)
		}
		resp = buf[:n]
	}
	var m dnsmessage.Message
	if err := m.Unpack(resp); err != nil {
		return fmt.Errorf("unpack response: %w", err)
	}
	if m.Header.ID != id {
		return errors.New("response ID does not match the query")
	}
	res.RCode = strings.TrimPrefix(m.Header.RCode.String(), "RCode")
	res.Answers = answerAddrs(resp)
	return nil
}

func fqdn(s string) string {
	if s == "" || s[len(s)-1] != '.' {
		return s + "."
	}
	return s
}
