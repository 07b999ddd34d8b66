// Package proxysim is a stand-in sidecar proxy: it behaves like Envoy as far as the
// traffic redirect is concerned, and nothing more.
//
// It listens on the outbound (15001) and inbound (15006) capture ports, recovers each
// accepted connection's original destination (SO_ORIGINAL_DST, IP6T_SO_ORIGINAL_DST or,
// for a TPROXY inbound listener, the local address) and then either answers with one
// JSON line describing what it saw (ModeRecord) or dials the original destination
// itself and splices bytes both ways (ModeForward). Because the proxy runs as the proxy
// UID, its own dials prove the UID exemption of the redirect rules. An optional DNS
// listener (15053, UDP and TCP) answers A/AAAA queries with fixed addresses or forwards
// them to an upstream, which proves DNS capture and that the proxy's own upstream
// queries do not loop.
//
// Every accepted connection or query is reported as a Record: kept in memory, passed to
// Config.OnRecord and served by AdminHandler.
package proxysim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Mode says what the proxy does with an accepted connection.
type Mode string

const (
	// ModeRecord answers with the connection's Record as one JSON line and closes.
	ModeRecord Mode = "record"
	// ModeForward dials the original destination and splices bytes both ways.
	ModeForward Mode = "forward"
)

// ParseMode parses "record" or "forward".
func ParseMode(s string) (Mode, error) {
	switch m := Mode(s); m {
	case ModeRecord, ModeForward:
		return m, nil
	default:
		return "", fmt.Errorf("unknown mode %q (want %q or %q)", s, ModeRecord, ModeForward)
	}
}

// Listener names used in records.
const (
	ListenerOutbound = "outbound"
	ListenerInbound  = "inbound"
	ListenerDNS      = "dns"
)

// Record events.
const (
	EventReady = "ready" // all listeners are bound
	EventConn  = "conn"  // a TCP connection was accepted on a capture listener
	EventDNS   = "dns"   // a DNS query was answered (or forwarded)
)

// Record describes one accepted connection or DNS query.
type Record struct {
	Event    string `json:"event"`
	Listener string `json:"listener,omitempty"`
	Proto    string `json:"proto,omitempty"` // tcp or udp
	// Peer is the client's address as the proxy sees it.
	Peer netip.AddrPort `json:"peer,omitzero"`
	// Local is the accepted socket's local address (the capture listener after REDIRECT).
	Local netip.AddrPort `json:"local,omitzero"`
	// OrigDst is the original destination: SO_ORIGINAL_DST / IP6T_SO_ORIGINAL_DST, or
	// the local address on a TPROXY listener.
	OrigDst    netip.AddrPort `json:"orig_dst,omitzero"`
	OrigDstErr string         `json:"orig_dst_error,omitempty"`
	// Forward is the address the proxy dialed in ModeForward, ForwardSource the local
	// address it dialed from.
	Forward       netip.AddrPort `json:"forward,omitzero"`
	ForwardSource netip.AddrPort `json:"forward_source,omitzero"`
	ForwardErr    string         `json:"forward_error,omitempty"`
	// DNS fields.
	Query       string         `json:"query,omitempty"`
	QueryType   string         `json:"query_type,omitempty"`
	Answers     []netip.Addr   `json:"answers,omitempty"`
	Upstream    netip.AddrPort `json:"upstream,omitzero"`
	UpstreamErr string         `json:"upstream_error,omitempty"`
	// Ready fields.
	Listeners []string `json:"listeners,omitempty"`
	// UID and GID of the proxy process.
	UID  int       `json:"uid"`
	GID  int       `json:"gid"`
	Time time.Time `json:"time"`
}

// Config configures a Proxy. The zero value of a port disables that listener.
type Config struct {
	Mode         Mode
	OutboundPort uint16 // Envoy's outbound capture port, 15001
	InboundPort  uint16 // Envoy's inbound capture port, 15006
	DNSPort      uint16 // istio-agent's DNS port, 15053; 0 = no DNS listener
	IPv4, IPv6   bool   // which families to listen on

	// ListenV4/ListenV6 are the capture listeners' addresses (default 0.0.0.0 / ::).
	ListenV4, ListenV6 netip.Addr
	// DNSListenV4/DNSListenV6 are the DNS listeners' addresses (default 127.0.0.1 /
	// ::1: a REDIRECTed local packet lands on loopback, and a UDP reply must leave from
	// the address the query was redirected to).
	DNSListenV4, DNSListenV6 netip.Addr

	// TPROXY sets IP_TRANSPARENT on the inbound listener and takes its connections'
	// original destination from their local address (needs CAP_NET_ADMIN).
	TPROXY bool
	// InboundSourceV4/V6 is the source address for dials made for inbound connections
	// in ModeForward (Istio's inbound passthrough uses 127.0.0.6 / ::6). Invalid = any.
	InboundSourceV4, InboundSourceV6 netip.Addr

	// DNSAnswerV4/V6 answer every A/AAAA query (invalid = empty answer).
	DNSAnswerV4, DNSAnswerV6 netip.Addr
	// DNSUpstream, when valid, receives every query instead (forwarded as is).
	DNSUpstream netip.AddrPort

	// NoSplice copies forwarded bytes through a user-space buffer (read/write, as
	// Envoy does) instead of splice(2), which reads only a socket's TCP receive
	// queue and so misses bytes an sk_msg program redirected into it.
	NoSplice bool

	DialTimeout time.Duration // forward and upstream dials, default 5s
	IdleTimeout time.Duration // idle limit for record-mode reads and DNS over TCP, default 30s
	MaxRecords  int           // records kept in memory, default 10000

	Logger   *slog.Logger
	OnRecord func(Record) // called for every record, from many goroutines
}

func (c *Config) defaults() error {
	if c.Mode == "" {
		c.Mode = ModeRecord
	}
	if _, err := ParseMode(string(c.Mode)); err != nil {
		return err
	}
	if !c.IPv4 && !c.IPv6 {
		return errors.New("neither IPv4 nor IPv6 enabled")
	}
	if c.OutboundPort == 0 && c.InboundPort == 0 && c.DNSPort == 0 {
		return errors.New("no listener configured")
	}
	if c.OutboundPort != 0 && c.OutboundPort == c.InboundPort {
		return fmt.Errorf("outbound and inbound port are both %d", c.OutboundPort)
	}
	setAddr := func(a *netip.Addr, def netip.Addr, is4 bool, name string) error {
		if !a.IsValid() {
			*a = def
			return nil
		}
		if a.Is4() != is4 {
			return fmt.Errorf("%s %v has the wrong address family", name, *a)
		}
		return nil
	}
	for _, s := range []struct {
		a    *netip.Addr
		def  netip.Addr
		is4  bool
		name string
	}{
		{&c.ListenV4, netip.IPv4Unspecified(), true, "listen-v4"},
		{&c.ListenV6, netip.IPv6Unspecified(), false, "listen-v6"},
		{&c.DNSListenV4, netip.AddrFrom4([4]byte{127, 0, 0, 1}), true, "dns-listen-v4"},
		{&c.DNSListenV6, netip.IPv6Loopback(), false, "dns-listen-v6"},
	} {
		if err := setAddr(s.a, s.def, s.is4, s.name); err != nil {
			return err
		}
	}
	if c.InboundSourceV4.IsValid() && !c.InboundSourceV4.Is4() {
		return fmt.Errorf("inbound source %v is not IPv4", c.InboundSourceV4)
	}
	if c.InboundSourceV6.IsValid() && !c.InboundSourceV6.Is6() {
		return fmt.Errorf("inbound source %v is not IPv6", c.InboundSourceV6)
	}
	if c.DNSAnswerV4.IsValid() && !c.DNSAnswerV4.Is4() {
		return fmt.Errorf("DNS answer %v is not IPv4", c.DNSAnswerV4)
	}
	if c.DNSAnswerV6.IsValid() && !c.DNSAnswerV6.Is6() {
		return fmt.Errorf("DNS answer %v is not IPv6", c.DNSAnswerV6)
	}
	if c.DialTimeout <= 0 {
		c.DialTimeout = 5 * time.Second
	}
	if c.IdleTimeout <= 0 {
		c.IdleTimeout = 30 * time.Second
	}
	if c.MaxRecords <= 0 {
		c.MaxRecords = 10000
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return nil
}

// Proxy is a running stand-in sidecar. Create it with New, bind with Listen (in the
// network namespace it should serve), then Serve.
type Proxy struct {
	cfg Config
	log *slog.Logger

	tcp []*tcpListener
	udp []*net.UDPConn
	dns []*net.TCPListener

	mu      sync.Mutex
	records []Record
	wg      sync.WaitGroup
}

type tcpListener struct {
	name   string
	ln     *net.TCPListener
	tproxy bool
}

// New validates cfg and fills its defaults.
func New(cfg Config) (*Proxy, error) {
	if err := cfg.defaults(); err != nil {
		return nil, fmt.Errorf("proxysim config: %w", err)
	}
	return &Proxy{cfg: cfg, log: cfg.Logger}, nil
}

// Config returns the effective configuration (defaults filled in).
func (p *Proxy) Config() Config { return p.cfg }

// Listen binds every configured socket. Sockets belong to the network namespace of the
// calling thread, so call it from the namespace the proxy serves. On error nothing
// stays bound.
func (p *Proxy) Listen() (err error) {
	defer func() {
		if err != nil {
			p.closeAll()
		}
	}()
	type fam struct {
		on          bool
		network     string
		listen, dns netip.Addr
	}
	for _, f := range []fam{
		{p.cfg.IPv4, "4", p.cfg.ListenV4, p.cfg.DNSListenV4},
		{p.cfg.IPv6, "6", p.cfg.ListenV6, p.cfg.DNSListenV6},
	} {
		if !f.on {
			continue
		}
		for _, l := range []struct {
			name   string
			port   uint16
			tproxy bool
		}{
			{ListenerOutbound, p.cfg.OutboundPort, false},
			{ListenerInbound, p.cfg.InboundPort, p.cfg.TPROXY},
		} {
			if l.port == 0 {
				continue
			}
			addr := netip.AddrPortFrom(f.listen, l.port)
			lc := net.ListenConfig{Control: socketOptions(l.tproxy)}
			ln, err := lc.Listen(context.Background(), "tcp"+f.network, addr.String())
			if err != nil {
				return fmt.Errorf("listen %s on %v: %w", l.name, addr, err)
			}
			p.tcp = append(p.tcp, &tcpListener{name: l.name, ln: ln.(*net.TCPListener), tproxy: l.tproxy})
		}
		if p.cfg.DNSPort != 0 {
			addr := netip.AddrPortFrom(f.dns, p.cfg.DNSPort)
			lc := net.ListenConfig{Control: socketOptions(false)}
			pc, err := lc.ListenPacket(context.Background(), "udp"+f.network, addr.String())
			if err != nil {
				return fmt.Errorf("listen dns/udp on %v: %w", addr, err)
			}
			p.udp = append(p.udp, pc.(*net.UDPConn))
			ln, err := lc.Listen(context.Background(), "tcp"+f.network, addr.String())
			if err != nil {
				return fmt.Errorf("listen dns/tcp on %v: %w", addr, err)
			}
			p.dns = append(p.dns, ln.(*net.TCPListener))
		}
	}
	return nil
}

// socketOptions sets SO_REUSEADDR and, for a TPROXY listener, IP_TRANSPARENT /
// IPV6_TRANSPARENT.
func socketOptions(transparent bool) func(network, address string, c syscall.RawConn) error {
	return func(network, _ string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) {
			if serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEADDR, 1); serr != nil {
				serr = fmt.Errorf("SO_REUSEADDR: %w", serr)
				return
			}
			if !transparent {
				return
			}
			if network == "tcp6" || network == "udp6" {
				if serr = unix.SetsockoptInt(int(fd), unix.SOL_IPV6, unix.IPV6_TRANSPARENT, 1); serr != nil {
					serr = fmt.Errorf("IPV6_TRANSPARENT (needs CAP_NET_ADMIN): %w", serr)
				}
				return
			}
			if serr = unix.SetsockoptInt(int(fd), unix.SOL_IP, unix.IP_TRANSPARENT, 1); serr != nil {
				serr = fmt.Errorf("IP_TRANSPARENT (needs CAP_NET_ADMIN): %w", serr)
			}
		})
		if err != nil {
			return err
		}
		return serr
	}
}

// Addrs lists the bound listeners as "name/proto address".
func (p *Proxy) Addrs() []string {
	var out []string
	for _, l := range p.tcp {
		out = append(out, fmt.Sprintf("%s/tcp %v", l.name, l.ln.Addr()))
	}
	for _, c := range p.udp {
		out = append(out, fmt.Sprintf("%s/udp %v", ListenerDNS, c.LocalAddr()))
	}
	for _, l := range p.dns {
		out = append(out, fmt.Sprintf("%s/tcp %v", ListenerDNS, l.Addr()))
	}
	return out
}

// Serve accepts connections and queries until ctx is done, then closes every socket
// and waits for in-flight connections to finish. Listen must have succeeded first.
func (p *Proxy) Serve(ctx context.Context) error {
	if len(p.tcp)+len(p.udp)+len(p.dns) == 0 {
		return errors.New("proxysim: Serve before Listen")
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errc := make(chan error, len(p.tcp)+len(p.udp)+len(p.dns))
	for _, l := range p.tcp {
		go func() { errc <- p.acceptLoop(ctx, l) }()
	}
	for _, c := range p.udp {
		go func() { errc <- p.serveDNSUDP(ctx, c) }()
	}
	for _, l := range p.dns {
		go func() { errc <- p.serveDNSTCP(ctx, l) }()
	}
	p.emit(Record{Event: EventReady, Listeners: p.Addrs()})
	p.log.Info("proxysim ready", "mode", p.cfg.Mode, "listeners", p.Addrs(), "uid", os.Getuid())

	var first error
	select {
	case <-ctx.Done():
	case first = <-errc:
	}
	cancel()
	p.closeAll()
	p.wg.Wait()
	return first
}

func (p *Proxy) closeAll() {
	for _, l := range p.tcp {
		_ = l.ln.Close()
	}
	for _, c := range p.udp {
		_ = c.Close()
	}
	for _, l := range p.dns {
		_ = l.Close()
	}
}

// emit stamps r, stores it, hands it to OnRecord and returns the stamped record.
func (p *Proxy) emit(r Record) Record {
	r.UID, r.GID = os.Getuid(), os.Getgid()
	if r.Time.IsZero() {
		r.Time = time.Now().UTC()
	}
	p.mu.Lock()
	if len(p.records) >= p.cfg.MaxRecords {
		p.records = append(p.records[:0], p.records[1:]...)
	}
	p.records = append(p.records, r)
	p.mu.Unlock()
	if p.cfg.OnRecord != nil {
		p.cfg.OnRecord(r)
	}
	return r
}

// Records returns a copy of the records kept so far, oldest first.
func (p *Proxy) Records() []Record {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]Record(nil), p.records...)
}

// AdminHandler serves GET /records (JSON array) and GET /healthz.
func (p *Proxy) AdminHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /records", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		if err := json.NewEncoder(w).Encode(p.Records()); err != nil {
			p.log.Warn("write records", "err", err)
		}
	})
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok\n"))
	})
	return mux
}
