package proxysim

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"time"

	"golang.org/x/net/dns/dnsmessage"
)

const maxDNSMessage = 65535

func (p *Proxy) serveDNSUDP(ctx context.Context, c *net.UDPConn) error {
	buf := make([]byte, maxDNSMessage)
	for {
		n, peer, err := c.ReadFromUDPAddrPort(buf)
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return nil
			}
			p.log.Warn("dns read failed", "err", err)
			continue
		}
		query := append([]byte(nil), buf[:n]...)
		local := unmapped(c.LocalAddr().(*net.UDPAddr).AddrPort())
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			resp, ok := p.answer(ctx, query, "udp", unmapped(peer), local)
			if !ok {
				return
			}
			if _, err := c.WriteToUDPAddrPort(resp, peer); err != nil && ctx.Err() == nil {
				p.log.Warn("dns write failed", "peer", peer, "err", err)
			}
		}()
	}
}

func (p *Proxy) serveDNSTCP(ctx context.Context, l *net.TCPListener) error {
	for {
		c, err := l.AcceptTCP()
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return nil
			}
			p.log.Warn("dns accept failed", "err", err)
			time.Sleep(10 * time.Millisecond)
			continue
		}
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			defer c.Close()
			stop := context.AfterFunc(ctx, func() { _ = c.Close() })
			defer stop()
			peer, local := tcpAddrPort(c.RemoteAddr()), tcpAddrPort(c.LocalAddr())
			for {
				_ = c.SetDeadline(time.Now().Add(p.cfg.IdleTimeout))
				query, err := readFramed(c)
				if err != nil {
					return
				}
				resp, ok := p.answer(ctx, query, "tcp", peer, local)
				if !ok {
					return
				}
				if err := writeFramed(c, resp); err != nil {
					return
				}
			}
		}()
	}
}

func readFramed(r io.Reader) ([]byte, error) {
	var l [2]byte
	if _, err := io.ReadFull(r, l[:]); err != nil {
		return nil, err
	}
	msg := make([]byte, binary.BigEndian.Uint16(l[:]))
	if _, err := io.ReadFull(r, msg); err != nil {
		return nil, err
	}
	return msg, nil
}

func writeFramed(w io.Writer, msg []byte) error {
	if len(msg) > maxDNSMessage {
		return fmt.Errorf("DNS message of %d bytes", len(msg))
	}
	b := make([]byte, 2, 2+len(msg))
	binary.BigEndian.PutUint16(b, uint16(len(msg)))
	_, err := w.Write(append(b, msg...))
	return err
}

// answer records the query and builds the response: from the upstream when one is
// configured, from the fixed answers otherwise. ok is false for unparsable input.
func (p *Proxy) answer(ctx context.Context, query []byte, proto string, peer, local netip.AddrPort) (resp []byte, ok bool) {
	var parser dnsmessage.Parser
	hdr, err := parser.Start(query)
	if err != nil {
		p.log.Warn("dns: unparsable query", "peer", peer, "err", err)
		return nil, false
	}
	q, err := parser.Question()
	if err != nil {
		p.log.Warn("dns: query without question", "peer", peer, "err", err)
		return nil, false
	}
	rec := Record{
		Event: EventDNS, Listener: ListenerDNS, Proto: proto,
		Peer: peer, Local: local,
		Query: q.Name.String(), QueryType: strings.TrimPrefix(q.Type.String(), "Type"),
	}
	if p.cfg.DNSUpstream.IsValid() {
		rec.Upstream = p.cfg.DNSUpstream
		resp, err = p.forwardDNS(ctx, query, proto)
		if err != nil {
			rec.UpstreamErr = err.Error()
			p.emit(rec)
			p.log.Warn("dns upstream failed", "query", rec.Query, "upstream", rec.Upstream, "err", err)
			resp, _ = reply(hdr, q, dnsmessage.RCodeServerFailure, nil)
			return resp, resp != nil
		}
		rec.Answers = answerAddrs(resp)
		p.emit(rec)
		p.log.Info("dns", "proto", proto, "peer", peer, "query", rec.Query, "type", rec.QueryType, "upstream", rec.Upstream, "answers", rec.Answers)
		return resp, true
	}
	var ans []netip.Addr
	switch {
	case q.Type == dnsmessage.TypeA && p.cfg.DNSAnswerV4.IsValid():
		ans = []netip.Addr{p.cfg.DNSAnswerV4}
	case q.Type == dnsmessage.TypeAAAA && p.cfg.DNSAnswerV6.IsValid():
		ans = []netip.Addr{p.cfg.DNSAnswerV6}
	}
	rec.Answers = ans
	resp, err = reply(hdr, q, dnsmessage.RCodeSuccess, ans)
	if err != nil {
		p.log.Warn("dns: build reply", "err", err)
		return nil, false
	}
	p.emit(rec)
	p.log.Info("dns", "proto", proto, "peer", peer, "query", rec.Query, "type", rec.QueryType, "answers", ans)
	return resp, true
}

func reply(hdr dnsmessage.Header, q dnsmessage.Question, rcode dnsmessage.RCode, ans []netip.Addr) ([]byte, error) {
	b := dnsmessage.NewBuilder(make([]byte, 0, 512), dnsmessage.Header{
		ID: hdr.ID, Response: true, Authoritative: true,
		RecursionDesired: hdr.RecursionDesired, RecursionAvailable: true, RCode: rcode,
	})
	b.EnableCompression()
	if err := b.StartQuestions(); err != nil {
		return nil, err
	}
	if err := b.Question(q); err != nil {
		return nil, err
	}
	if err := b.StartAnswers(); err != nil {
		return nil, err
	}
	rh := dnsmessage.ResourceHeader{Name: q.Name, Class: dnsmessage.ClassINET, TTL: 30}
	for _, a := range ans {
		var err error
		if a.Is4() {
			err = b.AResource(rh, dnsmessage.AResource{A: a.As4()})
		} else {
			err = b.AAAAResource(rh, dnsmessage.AAAAResource{AAAA: a.As16()})
		}
		if err != nil {
			return nil, err
		}
	}
	return b.Finish()
}

// forwardDNS relays one query to the upstream over the same protocol.
func (p *Proxy) forwardDNS(ctx context.Context, query []byte, proto string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, p.cfg.DialTimeout)
	defer cancel()
	var d net.Dialer
	c, err := d.DialContext(ctx, proto, p.cfg.DNSUpstream.String())
	if err != nil {
		return nil, fmt.Errorf("dial upstream: %w", err)
	}
	defer c.Close()
	if dl, ok := ctx.Deadline(); ok {
		_ = c.SetDeadline(dl)
	}
	if proto == "tcp" {
		if err := writeFramed(c, query); err != nil {
			return nil, fmt.Errorf("write upstream: %w", err)
		}
		resp, err := readFramed(c)
		if err != nil {
			return nil, fmt.Errorf("read upstream: %w", err)
		}
		return resp, nil
	}
	if _, err := c.Write(query); err != nil {
		return nil, fmt.Errorf("write upstream: %w", err)
	}
	buf := make([]byte, maxDNSMessage)
	n, err := c.Read(buf)
	if err != nil {
		return nil, fmt.Errorf("read upstream: %w", err)
	}
	return buf[:n], nil
}

// answerAddrs extracts the A/AAAA answers of a response (best effort).
func answerAddrs(msg []byte) []netip.Addr {
	var m dnsmessage.Message
	if err := m.Unpack(msg); err != nil {
		return nil
	}
	var out []netip.Addr
	for _, a := range m.Answers {
		switch r := a.Body.(type) {
		case *dnsmessage.AResource:
			out = append(out, netip.AddrFrom4(r.A))
		case *dnsmessage.AAAAResource:
			out = append(out, netip.AddrFrom16(r.AAAA))
		}
	}
	return out
}
