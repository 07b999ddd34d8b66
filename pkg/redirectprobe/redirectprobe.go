// Package redirectprobe is the logic of the validation init container (meshcnictl
// validate, Istio's istio-validation): it proves, from inside the pod and as
// the proxy UID (non-root, no capabilities), that the sidecar redirect is in place.
// It behaves like Istio's `istio-iptables --run-validation`:
//
//   - listen on the outbound and inbound capture ports (15001, 15006) on loopback
//     (127.0.0.1; ::1 when IPv6 is validated);
//   - dial 127.0.0.6:15002 ([::6]:15002) from 127.0.0.1 ([::1]), an address and port
//     nothing serves: only the redirect can deliver that connection to a capture port
//     (as the proxy UID, outbound to a loopback address other than 127.0.0.1, Istio's
//     rules send it to the inbound capture port);
//   - succeed once a capture listener accepts that very connection (it carries a random
//     token) with SO_ORIGINAL_DST exactly 127.0.0.6:15002; retry until the timeout
//     (5s) and fail with an *Error (exit code 126) otherwise.
//
// A connection accepted by anything else (say a listener on 15002, or a non-NATed
// connection to a capture port) never counts. Every enabled family must pass.
//
// All sockets are created on the calling goroutine, so Run may be called from a thread
// that has entered the pod's network namespace (ns.WithNetNSPath).
package redirectprobe

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/pkg/origdst"
)

// ExitCode is the exit status of a failed validation (Istio's ValidationErrorCode).
const ExitCode = 126

// Istio's defaults.
const (
	DefaultOutboundPort = 15001
	DefaultInboundPort  = 15006
	DefaultProbePort    = 15002
	DefaultTimeout      = 5 * time.Second
)

// The probe's addresses: only the redirect can bring a connection from the source to
// the destination's port onto a capture listener.
var (
	ProbeIPv4  = netip.AddrFrom4([4]byte{127, 0, 0, 6})
	ProbeIPv6  = netip.MustParseAddr("::6")
	ListenIPv4 = netip.AddrFrom4([4]byte{127, 0, 0, 1})
	ListenIPv6 = netip.IPv6Loopback()
)

// Config configures Run.
type Config struct {
	OutboundPort uint16        // Envoy's outbound capture port (-p, ENVOY_PORT)
	InboundPort  uint16        // inbound capture port (-z, INBOUND_CAPTURE_PORT)
	ProbePort    uint16        // port of the probe's destination (IPTABLES_PROBE_PORT)
	Timeout      time.Duration // overall bound (PROBE_TIMEOUT)
	IPv4         bool          // validate IPv4 (127.0.0.1 / 127.0.0.6)
	IPv6         bool          // validate IPv6 (::1 / ::6)
	// RetryInterval is the pause between probes of a family (default 250ms).
	RetryInterval time.Duration
	Logger        *slog.Logger
}

// DefaultConfig is Istio's: 15001, 15006, 15002, 5s, IPv4 only.
func DefaultConfig() Config {
	return Config{
		OutboundPort: DefaultOutboundPort,
		InboundPort:  DefaultInboundPort,
		ProbePort:    DefaultProbePort,
		Timeout:      DefaultTimeout,
		IPv4:         true,
	}
}

func (c *Config) check() error {
	if c.OutboundPort == 0 && c.InboundPort == 0 {
		return errors.New("no capture port (outbound and inbound are both 0)")
	}
	if c.ProbePort == 0 {
		return errors.New("probe port is 0")
	}
	if c.ProbePort == c.OutboundPort || c.ProbePort == c.InboundPort {
		return fmt.Errorf("probe port %d is a capture port: the check could pass without a redirect", c.ProbePort)
	}
	if c.Timeout <= 0 {
		return fmt.Errorf("timeout %v is not positive", c.Timeout)
	}
	if !c.IPv4 && !c.IPv6 {
		return errors.New("neither IPv4 nor IPv6 enabled")
	}
	if c.RetryInterval <= 0 {
		c.RetryInterval = 250 * time.Millisecond
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return nil
}

// Reason classifies a validation failure.
type Reason string

const (
	// ReasonConfig: the configuration cannot give a meaningful answer.
	ReasonConfig Reason = "config"
	// ReasonListen: a capture port could not be bound.
	ReasonListen Reason = "listen"
	// ReasonNoConnection: the probe never connected (refused, unreachable, dropped).
	ReasonNoConnection Reason = "no-connection"
	// ReasonNotRedirected: the probe connected, but not to a capture listener.
	ReasonNotRedirected Reason = "not-redirected"
	// ReasonWrongDestination: a capture listener got the probe, but its original
	// destination was not the probe address.
	ReasonWrongDestination Reason = "wrong-destination"
	// ReasonCanceled: the caller's context ended first.
	ReasonCanceled Reason = "canceled"
)

// Error is a failed validation. Its ExitCode is 126.
type Error struct {
	Reason    Reason
	Family    string         // "IPv4" or "IPv6" (empty for config errors)
	Probe     netip.AddrPort // 127.0.0.6:15002
	Listeners []netip.AddrPort
	Timeout   time.Duration
	Attempts  int
	Detail    string // last observation
	Err       error  // underlying error, if any
}

func (e *Error) Error() string {
	var b strings.Builder
	b.WriteString("sidecar redirect validation failed")
	if e.Family != "" {
		fmt.Fprintf(&b, " (%s)", e.Family)
	}
	switch e.Reason {
	case ReasonConfig:
		fmt.Fprintf(&b, ": invalid configuration: %s", e.Detail)
	case ReasonListen:
		fmt.Fprintf(&b, ": cannot listen on the capture port: %s", e.Detail)
	default:
		ls := make([]string, len(e.Listeners))
		for i, l := range e.Listeners {
			ls[i] = l.String()
		}
		fmt.Fprintf(&b, ": a connection to %v did not reach a capture listener (%s) with its original destination within %v (%d attempts): %s",
			e.Probe, strings.Join(ls, ", "), e.Timeout, e.Attempts, e.Detail)
		if e.Reason != ReasonCanceled {
			b.WriteString("; the pod's redirect rules are missing or incomplete")
		}
	}
	return b.String()
}

func (e *Error) Unwrap() error { return e.Err }

// ExitCode is 126.
func (e *Error) ExitCode() int { return ExitCode }

type family struct {
	name      string
	listen    netip.Addr
	probe     netip.AddrPort
	source    netip.Addr
	listeners []*net.TCPListener
	addrs     []netip.AddrPort

	mu       sync.Mutex
	done     bool
	attempts int
	reason   Reason
	detail   string // last client-side observation
	captured string // last server-side observation of a wrong destination
}

func (f *family) note(reason Reason, detail string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.reason, f.detail = reason, detail
}

func (f *family) isDone() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.done
}

// Run validates the redirect in the calling thread's network namespace. It returns nil
// on success and an *Error otherwise.
func Run(ctx context.Context, cfg Config) error {
	if err := cfg.check(); err != nil {
		return &Error{Reason: ReasonConfig, Detail: err.Error(), Err: err}
	}
	log := cfg.Logger
	token, err := newToken()
	if err != nil {
		return fmt.Errorf("validation token: %w", err)
	}
	var fams []*family
	if cfg.IPv4 {
		fams = append(fams, &family{name: "IPv4", listen: ListenIPv4, source: ListenIPv4, probe: netip.AddrPortFrom(ProbeIPv4, cfg.ProbePort)})
	}
	if cfg.IPv6 {
		fams = append(fams, &family{name: "IPv6", listen: ListenIPv6, source: ListenIPv6, probe: netip.AddrPortFrom(ProbeIPv6, cfg.ProbePort)})
	}
	ports := []uint16{}
	for _, p := range []uint16{cfg.OutboundPort, cfg.InboundPort} {
		if p != 0 && (len(ports) == 0 || ports[0] != p) {
			ports = append(ports, p)
		}
	}
	log.Info("starting redirect validation", "probe_port", cfg.ProbePort, "capture_ports", ports, "timeout", cfg.Timeout)

	var wg sync.WaitGroup
	defer wg.Wait()
	defer func() {
		for _, f := range fams {
			for _, l := range f.listeners {
				_ = l.Close()
			}
		}
	}()
	captured := make(chan struct{}, len(fams))
	for _, f := range fams {
		for _, port := range ports {
			addr := netip.AddrPortFrom(f.listen, port)
			lc := net.ListenConfig{Control: reuseAddr}
			network := "tcp6"
			if f.listen.Is4() {
				network = "tcp4"
			}
			ln, err := lc.Listen(ctx, network, addr.String())
			if err != nil {
				return &Error{Reason: ReasonListen, Family: f.name, Detail: fmt.Sprintf("listen on %v: %v", addr, err), Err: err}
			}
			f.listeners = append(f.listeners, ln.(*net.TCPListener))
			f.addrs = append(f.addrs, addr)
			log.Debug("listening", "addr", addr)
		}
		for _, ln := range f.listeners {
			wg.Add(1)
			go func() {
				defer wg.Done()
				serve(ln, f, token, captured, log)
			}()
		}
	}

	deadline := time.Now().Add(cfg.Timeout)
	ctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	for {
		pending := 0
		for _, f := range fams {
			if f.isDone() {
				continue
			}
			pending++
			probe(ctx, f, token, deadline)
		}
		if pending == 0 || allDone(fams) {
			log.Info("validation passed: the redirect delivers to the capture ports", "families", len(fams))
			return nil
		}
		timer := time.NewTimer(cfg.RetryInterval)
		select {
		case <-ctx.Done():
			timer.Stop()
			if allDone(fams) {
				log.Info("validation passed: the redirect delivers to the capture ports", "families", len(fams))
				return nil
			}
			return failure(ctx, cfg, fams)
		case <-captured:
			timer.Stop()
		case <-timer.C:
		}
	}
}

func allDone(fams []*family) bool {
	for _, f := range fams {
		if !f.isDone() {
			return false
		}
	}
	return true
}

func failure(ctx context.Context, cfg Config, fams []*family) error {
	for _, f := range fams {
		f.mu.Lock()
		done, reason, detail, captured, attempts := f.done, f.reason, f.detail, f.captured, f.attempts
		f.mu.Unlock()
		if done {
			continue
		}
		if captured != "" {
			reason, detail = ReasonWrongDestination, captured
		}
		if reason == "" {
			reason, detail = ReasonNoConnection, "no probe completed"
		}
		var cause error
		if errors.Is(context.Cause(ctx), context.Canceled) {
			reason, cause = ReasonCanceled, context.Canceled
			detail = "canceled; last: " + detail
		}
		err := &Error{
			Reason: reason, Family: f.name, Probe: f.probe, Listeners: f.addrs,
			Timeout: cfg.Timeout, Attempts: attempts, Detail: detail, Err: cause,
		}
		cfg.Logger.Error("validation failed", "family", f.name, "reason", reason, "detail", detail)
		return err
	}
	return nil
}

// probe makes one attempt: dial the probe address, send the token, read the echo.
func probe(ctx context.Context, f *family, token string, deadline time.Time) {
	f.mu.Lock()
	f.attempts++
	f.mu.Unlock()
	attempt := min(time.Until(deadline), time.Second)
	if attempt <= 0 {
		return
	}
	d := net.Dialer{Timeout: attempt, LocalAddr: net.TCPAddrFromAddrPort(netip.AddrPortFrom(f.source, 0))}
	c, err := d.DialContext(ctx, "tcp", f.probe.String())
	if err != nil {
		f.note(ReasonNoConnection, fmt.Sprintf("dial %v from %v: %v", f.probe, f.source, err))
		return
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(attempt))
	if _, err := io.WriteString(c, token+"\n"); err != nil {
		f.note(ReasonNotRedirected, fmt.Sprintf("connected to %v but the write failed: %v", f.probe, err))
		return
	}
	_ = c.(*net.TCPConn).CloseWrite()
	reply, _ := io.ReadAll(io.LimitReader(c, 64))
	if f.isDone() {
		return
	}
	if len(reply) == 0 {
		f.note(ReasonNotRedirected, fmt.Sprintf(
			"connected to %v, but no capture listener received the connection: it was not redirected (something else accepted it)", f.probe))
		return
	}
	f.note(ReasonWrongDestination, fmt.Sprintf("a capture listener answered %q", strings.TrimSpace(string(reply))))
}

// serve accepts on one capture listener; the probe counts only with the token and the
// exact original destination.
func serve(ln *net.TCPListener, f *family, token string, captured chan<- struct{}, log *slog.Logger) {
	for {
		c, err := ln.AcceptTCP()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			log.Warn("accept failed", "listener", ln.Addr(), "err", err)
			time.Sleep(10 * time.Millisecond)
			continue
		}
		check(c, f, token, captured, log)
	}
}

func check(c *net.TCPConn, f *family, token string, captured chan<- struct{}, log *slog.Logger) {
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(time.Second))
	line, err := bufio.NewReaderSize(io.LimitReader(c, 256), 256).ReadString('\n')
	if err != nil || strings.TrimSpace(line) != token {
		// Not our probe (a stray client): ignore it.
		log.Debug("ignoring a connection without the validation token", "listener", c.LocalAddr(), "peer", c.RemoteAddr())
		return
	}
	dst, err := origdst.Redirected(c)
	if err != nil {
		f.mu.Lock()
		f.captured = fmt.Sprintf("the probe reached capture listener %v without NAT: %v", c.LocalAddr(), err)
		f.mu.Unlock()
		_, _ = io.WriteString(c, "no-original-destination\n")
		return
	}
	if dst != f.probe {
		f.mu.Lock()
		f.captured = fmt.Sprintf("capture listener %v received the probe with original destination %v, want %v", c.LocalAddr(), dst, f.probe)
		f.mu.Unlock()
		_, _ = io.WriteString(c, strconv.Itoa(int(dst.Port()))+"\n")
		return
	}
	f.mu.Lock()
	f.done = true
	f.mu.Unlock()
	log.Info("probe captured", "family", f.name, "listener", c.LocalAddr(), "original_destination", dst)
	// Echo the original port, like Istio, for anyone debugging with a client.
	_, _ = io.WriteString(c, strconv.Itoa(int(dst.Port()))+"\n")
	select {
	case captured <- struct{}{}:
	default:
	}
}

func reuseAddr(_, _ string, c syscall.RawConn) error {
	var serr error
	if err := c.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEADDR, 1)
	}); err != nil {
		return err
	}
	if serr != nil {
		return fmt.Errorf("SO_REUSEADDR: %w", serr)
	}
	return nil
}

func newToken() (string, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", err
	}
	return "meshcni-validate-" + hex.EncodeToString(b[:]), nil
}
