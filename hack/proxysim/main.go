// Command meshcni-proxysim is a stand-in sidecar proxy for meshcni's tests and demo
// (see internal/standin/proxysim). It writes one JSON line per record to stdout (the first is a
// {"event":"ready"} record once every listener is bound) and logs JSON to stderr.
//
//	meshcni-proxysim [serve] [flags]     run the proxy
//	meshcni-proxysim client [flags]      one TCP probe, prints a JSON ProbeResult
//	meshcni-proxysim dns-client [flags]  one DNS query, prints a JSON DNSResult
//
// Build it static: CGO_ENABLED=0 go build ./hack/proxysim
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/spf13/pflag"

	"github.com/meshcni/meshcni/internal/standin/proxysim"
	"github.com/meshcni/meshcni/pkg/flagenv"
)

func main() {
	os.Exit(run(context.Background(), os.Args[1:], os.Stdout, os.Stderr))
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	ctx, stop := signal.NotifyContext(ctx, syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	cmd := "serve"
	if len(args) > 0 && (args[0] == "serve" || args[0] == "client" || args[0] == "dns-client") {
		cmd, args = args[0], args[1:]
	}
	var err error
	switch cmd {
	case "client":
		err = runClient(ctx, args, stdout, stderr)
	case "dns-client":
		err = runDNSClient(ctx, args, stdout, stderr)
	default:
		err = runServe(ctx, args, stdout, stderr)
	}
	if err != nil {
		if errors.Is(err, pflag.ErrHelp) {
			return 0
		}
		fmt.Fprintf(stderr, "meshcni-proxysim %s: %v\n", cmd, err)
		return 2
	}
	return 0
}

// addrValue is a pflag.Value holding an optional netip.Addr.
type addrValue struct{ a *netip.Addr }

func (addrValue) Type() string { return "addr" }

func (v addrValue) String() string {
	if v.a == nil || !v.a.IsValid() {
		return ""
	}
	return v.a.String()
}

func (v addrValue) Set(s string) error {
	if s == "" {
		*v.a = netip.Addr{}
		return nil
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return err
	}
	*v.a = a
	return nil
}

// addrPortValue is a pflag.Value holding an optional netip.AddrPort.
type addrPortValue struct{ ap *netip.AddrPort }

func (addrPortValue) Type() string { return "ip:port" }

func (v addrPortValue) String() string {
	if v.ap == nil || !v.ap.IsValid() {
		return ""
	}
	return v.ap.String()
}

func (v addrPortValue) Set(s string) error {
	if s == "" {
		*v.ap = netip.AddrPort{}
		return nil
	}
	ap, err := netip.ParseAddrPort(s)
	if err != nil {
		return err
	}
	*v.ap = ap
	return nil
}

// portValue is a pflag.Value holding a TCP/UDP port (0 allowed: disabled).
type portValue struct{ p *uint16 }

func (portValue) Type() string { return "port" }

func (v portValue) String() string {
	if v.p == nil {
		return "0"
	}
	return fmt.Sprint(*v.p)
}

func (v portValue) Set(s string) error {
	var n uint16
	if _, err := fmt.Sscan(s, &n); err != nil {
		return fmt.Errorf("port %q: %w", s, err)
	}
	if fmt.Sprint(n) != s {
		return fmt.Errorf("port %q is not a number in 0-65535", s)
	}
	*v.p = n
	return nil
}

func runServe(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := pflag.NewFlagSet("serve", pflag.ContinueOnError)
	fs.SetOutput(stderr)
	cfg := proxysim.Config{
		OutboundPort: 15001, InboundPort: 15006,
		InboundSourceV4: netip.AddrFrom4([4]byte{127, 0, 0, 6}),
		InboundSourceV6: netip.MustParseAddr("::6"),
	}
	mode := fs.String("mode", string(proxysim.ModeRecord), "record: answer each connection with its JSON record; forward: dial the original destination and splice")
	fs.Var(portValue{&cfg.OutboundPort}, "outbound-port", "outbound capture port (0 = off)")
	fs.Var(portValue{&cfg.InboundPort}, "inbound-port", "inbound capture port (0 = off)")
	fs.Var(portValue{&cfg.DNSPort}, "dns-port", "DNS port, UDP and TCP (0 = off; istio-agent uses 15053)")
	fs.BoolVar(&cfg.IPv4, "ipv4", true, "listen on IPv4")
	fs.BoolVar(&cfg.IPv6, "ipv6", true, "listen on IPv6")
	fs.Var(addrValue{&cfg.ListenV4}, "listen-v4", "capture listeners' IPv4 address (default 0.0.0.0)")
	fs.Var(addrValue{&cfg.ListenV6}, "listen-v6", "capture listeners' IPv6 address (default ::)")
	fs.Var(addrValue{&cfg.DNSListenV4}, "dns-listen-v4", "DNS listeners' IPv4 address (default 127.0.0.1)")
	fs.Var(addrValue{&cfg.DNSListenV6}, "dns-listen-v6", "DNS listeners' IPv6 address (default ::1)")
	fs.BoolVar(&cfg.TPROXY, "tproxy", false, "inbound listener is transparent (IP_TRANSPARENT; needs CAP_NET_ADMIN); original destination = local address")
	fs.Var(addrValue{&cfg.InboundSourceV4}, "inbound-source", "IPv4 source of forwarded inbound dials (Istio: 127.0.0.6; empty = any)")
	fs.Var(addrValue{&cfg.InboundSourceV6}, "inbound-source-v6", "IPv6 source of forwarded inbound dials (Istio: ::6; empty = any)")
	fs.Var(addrValue{&cfg.DNSAnswerV4}, "dns-answer", "address answered to every A query (empty = no answer)")
	fs.Var(addrValue{&cfg.DNSAnswerV6}, "dns-answer-v6", "address answered to every AAAA query (empty = no answer)")
	fs.Var(addrPortValue{&cfg.DNSUpstream}, "dns-upstream", "forward every DNS query to this ip:port instead of answering")
	fs.BoolVar(&cfg.NoSplice, "no-splice", false, "forward mode: copy through a user-space buffer (read/write, as Envoy does) instead of splice(2)")
	fs.DurationVar(&cfg.DialTimeout, "dial-timeout", 5*time.Second, "timeout of forward and upstream dials")
	admin := fs.String("admin", "", "serve GET /records and /healthz on this address (e.g. 127.0.0.1:15000)")
	records := fs.Bool("records", true, "write every record to stdout as a JSON line")
	level := fs.String("log-level", "info", "debug, info, warn or error")
	if err := fs.Parse(flagenv.GoStyle(fs, args)); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	m, err := proxysim.ParseMode(*mode)
	if err != nil {
		return err
	}
	cfg.Mode = m
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(*level)); err != nil {
		return fmt.Errorf("log level: %w", err)
	}
	logger := slog.New(slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: lvl}))
	cfg.Logger = logger
	if *records {
		var mu sync.Mutex
		enc := json.NewEncoder(stdout)
		cfg.OnRecord = func(r proxysim.Record) {
			mu.Lock()
			defer mu.Unlock()
			if err := enc.Encode(r); err != nil {
				logger.Warn("write record", "err", err)
			}
		}
	}
	p, err := proxysim.New(cfg)
	if err != nil {
		return err
	}
	if err := p.Listen(); err != nil {
		return err
	}
	if *admin != "" {
		ln, err := net.Listen("tcp", *admin)
		if err != nil {
			return fmt.Errorf("admin listener: %w", err)
		}
		srv := &http.Server{Handler: p.AdminHandler(), ReadHeaderTimeout: 5 * time.Second}
		go func() {
			if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				logger.Error("admin server", "err", err)
			}
		}()
		defer srv.Close()
	}
	return p.Serve(ctx)
}

func runClient(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := pflag.NewFlagSet("client", pflag.ContinueOnError)
	fs.SetOutput(stderr)
	var req proxysim.ProbeRequest
	fs.Var(addrPortValue{&req.Dst}, "connect", "ip:port to connect to (required)")
	fs.Var(addrPortValue{&req.Source}, "source", "local ip:port to bind (optional)")
	fs.StringVar(&req.Send, "send", "", "payload to send before half-closing")
	fs.DurationVar(&req.Timeout, "timeout", 3*time.Second, "bound on the whole probe")
	if err := fs.Parse(flagenv.GoStyle(fs, args)); err != nil {
		return err
	}
	if !req.Dst.IsValid() {
		return errors.New("--connect is required")
	}
	return json.NewEncoder(stdout).Encode(proxysim.Probe(ctx, req))
}

func runDNSClient(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := pflag.NewFlagSet("dns-client", pflag.ContinueOnError)
	fs.SetOutput(stderr)
	var req proxysim.DNSRequest
	fs.Var(addrPortValue{&req.Server}, "server", "DNS server ip:port (required)")
	fs.StringVar(&req.Name, "name", "", "name to resolve (required)")
	qtype := fs.String("type", "A", "A or AAAA")
	fs.BoolVar(&req.TCP, "tcp", false, "query over TCP")
	fs.DurationVar(&req.Timeout, "timeout", 3*time.Second, "bound on the whole query")
	if err := fs.Parse(flagenv.GoStyle(fs, args)); err != nil {
		return err
	}
	if !req.Server.IsValid() || req.Name == "" {
		return errors.New("--server and --name are required")
	}
	t, err := proxysim.ParseDNSType(*qtype)
	if err != nil {
		return err
	}
	req.Type = t
	return json.NewEncoder(stdout).Encode(proxysim.QueryDNS(ctx, req))
}
