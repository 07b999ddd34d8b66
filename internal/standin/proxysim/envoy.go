package proxysim

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/spf13/pflag"
)

// The Envoy face: a stand-in that pilot-agent starts as it starts Envoy
// (/usr/local/bin/envoy -c etc/istio/proxy/envoy-rev.json --drain-time-s 45 …, as
// UID 1337, cwd /). It reads the bootstrap pilot-agent rendered, speaks ADS to
// pilot-agent's XDS proxy (and so to istiod) and counts what it accepted in the stats
// pilot-agent's readiness check reads, serves the admin endpoints on the bootstrap's
// admin address, forwards the health listener (15021 /healthz/ready) to pilot-agent's
// status port, and captures on 15001/15006 with the Proxy of this package in
// ModeForward. Nothing of Envoy itself runs.

// EnvoyArgs is Envoy's command line as pilot-agent writes it.
type EnvoyArgs struct {
	ConfigPath      string
	ConfigYAML      string
	DrainTime       time.Duration
	DrainStrategy   string
	IPVersion       string // --local-address-ip-version: v4 or v6
	LogLevel        string
	ComponentLogLvl string
	Concurrency     int
	// Ignored lists the flags accepted and ignored.
	Ignored []string
}

// ParseEnvoyArgs parses Envoy's command line. Flags Envoy has that do not matter to
// the stand-in are accepted; an unknown flag, a missing -c or a bad value is an
// error, as in Envoy.
func ParseEnvoyArgs(args []string) (EnvoyArgs, error) {
	var a EnvoyArgs
	fs := pflag.NewFlagSet("envoy", pflag.ContinueOnError)
	fs.SetOutput(discard{})
	fs.StringVarP(&a.ConfigPath, "config-path", "c", "", "bootstrap file")
	fs.StringVar(&a.ConfigYAML, "config-yaml", "", "bootstrap override (ignored)")
	drain := fs.Int("drain-time-s", 600, "drain time in seconds")
	fs.StringVar(&a.DrainStrategy, "drain-strategy", "gradual", "drain strategy")
	fs.StringVar(&a.IPVersion, "local-address-ip-version", "v4", "v4 or v6")
	fs.StringVarP(&a.LogLevel, "log-level", "l", "info", "log level")
	fs.StringVar(&a.ComponentLogLvl, "component-log-level", "", "component log levels")
	fs.IntVar(&a.Concurrency, "concurrency", 0, "worker threads")
	ignoredBool := []string{"disable-hot-restart", "allow-unknown-static-fields", "skip-deprecated-logs", "enable-core-dump", "use-dynamic-base-id", "reject-unknown-dynamic-fields"}
	for _, n := range ignoredBool {
		fs.Bool(n, false, "ignored")
	}
	ignoredString := []string{"file-flush-interval-msec", "file-flush-min-size-kb", "parent-shutdown-time-s", "restart-epoch", "service-cluster", "service-node", "service-zone", "log-format", "base-id", "base-id-path", "mode"}
	for _, n := range ignoredString {
		fs.String(n, "", "ignored")
	}
	if err := fs.Parse(args); err != nil {
		return a, fmt.Errorf("envoy command line: %w", err)
	}
	if fs.NArg() > 0 {
		return a, fmt.Errorf("envoy command line: unexpected argument %q", fs.Arg(0))
	}
	if a.ConfigPath == "" {
		return a, errors.New("envoy command line: no -c/--config-path")
	}
	if *drain < 0 {
		return a, fmt.Errorf("envoy command line: --drain-time-s %d is negative", *drain)
	}
	a.DrainTime = time.Duration(*drain) * time.Second
	if a.IPVersion != "v4" && a.IPVersion != "v6" {
		return a, fmt.Errorf("envoy command line: --local-address-ip-version %q (want v4 or v6)", a.IPVersion)
	}
	fs.Visit(func(f *pflag.Flag) {
		if f.Usage == "ignored" {
			a.Ignored = append(a.Ignored, f.Name)
		}
	})
	return a, nil
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }

// EnvoyConfig configures the Envoy face.
type EnvoyConfig struct {
	Args EnvoyArgs
	// Dir resolves relative paths of the command line and bootstrap (Envoy's
	// working directory; "" = the current one).
	Dir string
	// DualStack listens for capture on IPv4 and IPv6 (pilot-agent's
	// ISTIO_DUAL_STACK); otherwise the family of --local-address-ip-version.
	DualStack bool
	// TPROXY makes the inbound capture listener transparent (IP_TRANSPARENT, needs
	// CAP_NET_ADMIN) and takes the original destination from the accepted socket's
	// local address, as Envoy's virtual inbound listener does when istiod configures
	// it for a TPROXY proxy (pilot-agent's ISTIO_META_INTERCEPTION_MODE=TPROXY).
	TPROXY   bool
	Logger   *slog.Logger
	OnRecord func(Record)
}

// Envoy is a running Envoy face.
type Envoy struct {
	Args      EnvoyArgs
	Bootstrap Bootstrap
	Stats     *EnvoyStats

	cfg   EnvoyConfig
	log   *slog.Logger
	proxy *Proxy

	quitOnce sync.Once
	quitCh   chan struct{}
}

// NewEnvoy reads the bootstrap named on the command line.
func NewEnvoy(cfg EnvoyConfig) (*Envoy, error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	bs, err := ReadBootstrap(Abs(cfg.Dir, cfg.Args.ConfigPath))
	if err != nil {
		return nil, err
	}
	e := &Envoy{Args: cfg.Args, Bootstrap: bs, Stats: NewEnvoyStats(), cfg: cfg, log: cfg.Logger, quitCh: make(chan struct{})}
	pc := Config{
		Mode: ModeForward, OutboundPort: 15001, InboundPort: 15006,
		IPv4:            cfg.DualStack || cfg.Args.IPVersion == "v4",
		IPv6:            cfg.DualStack || cfg.Args.IPVersion == "v6",
		InboundSourceV4: netip.AddrFrom4([4]byte{127, 0, 0, 6}),
		InboundSourceV6: netip.MustParseAddr("::6"),
		TPROXY:          cfg.TPROXY,
		Logger:          cfg.Logger,
		OnRecord:        cfg.OnRecord,
	}
	if e.proxy, err = New(pc); err != nil {
		return nil, err
	}
	return e, nil
}

func (e *Envoy) quit() { e.quitOnce.Do(func() { close(e.quitCh) }) }

// Run binds the admin, health and capture listeners, speaks ADS until ctx is done
// or /quitquitquit is called, and shuts down.
func (e *Envoy) Run(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-e.quitCh:
			e.log.Info("quitquitquit")
			cancel()
		case <-ctx.Done():
		}
	}()
	agentURL := &url.URL{Scheme: "http", Host: e.Bootstrap.Agent.String()}
	servers := []struct {
		name string
		addr netip.AddrPort
		h    http.Handler
	}{
		{"admin", e.Bootstrap.Admin, e.adminHandler()},
		{"health", e.Bootstrap.Health, healthHandler(agentURL)},
	}
	errc := make(chan error, len(servers)+2)
	for _, s := range servers {
		ln, err := net.Listen("tcp", s.addr.String())
		if err != nil {
			return fmt.Errorf("envoy %s listener on %v: %w", s.name, s.addr, err)
		}
		srv := &http.Server{Handler: s.h, ReadHeaderTimeout: 10 * time.Second}
		go func() { errc <- srv.Serve(ln) }()
		context.AfterFunc(ctx, func() { _ = srv.Close() })
	}
	if err := e.proxy.Listen(); err != nil {
		return fmt.Errorf("envoy capture listeners: %w", err)
	}
	go func() { errc <- e.proxy.Serve(ctx) }()
	go e.runADS(ctx)
	if e.Bootstrap.SDSPath != "" {
		go e.runSDS(ctx)
	}
	e.log.Info("envoy stand-in started", "bootstrap", e.Args.ConfigPath, "node", e.Bootstrap.Node.ID,
		"admin", e.Bootstrap.Admin, "health", e.Bootstrap.Health, "xds", e.Bootstrap.XDSPath, "tproxy", e.cfg.TPROXY, "ignored_flags", e.Args.Ignored)
	select {
	case <-ctx.Done():
		return nil
	case err := <-errc:
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
}

// runSDS asks pilot-agent's SDS server for the workload certificate and the root,
// as Envoy does for the transport sockets istiod's configuration names.
func (e *Envoy) runSDS(ctx context.Context) {
	path := Abs(e.cfg.Dir, e.Bootstrap.SDSPath)
	e.log.Info("SDS stream opening", "sds", path)
	for ctx.Err() == nil {
		err := RunSDS(ctx, path, e.Bootstrap.Node, []string{"default", "ROOTCA"}, e.onSecret)
		if ctx.Err() != nil {
			return
		}
		e.log.Warn("SDS stream closed; reconnecting", "sds", path, "err", err)
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
}

// onSecret counts SDS responses per secret (sds.<name>.update_success|rejected) and
// logs each certificate's identity.
func (e *Envoy) onSecret(u ADSUpdate) {
	for _, r := range u.Response.Resources {
		if u.Err != nil {
			e.Stats.Add("sds."+r.Name+".update_rejected", 1)
			continue
		}
		cert, _ := ParseSecretCert(r.Value) // validated before the ACK
		e.Stats.Add("sds."+r.Name+".update_success", 1)
		e.log.Info("sds secret accepted", "name", r.Name, "kind", cert.Kind, "uris", cert.URIs, "subject", cert.Subject, "not_after", cert.NotAfter)
	}
	if u.Err != nil {
		e.log.Warn("sds update rejected", "version", u.Response.VersionInfo, "err", u.Err)
	}
}

// runADS keeps an ADS stream to the bootstrap's xds-grpc pipe, reconnecting after a
// failure as Envoy does.
func (e *Envoy) runADS(ctx context.Context) {
	path := Abs(e.cfg.Dir, e.Bootstrap.XDSPath)
	e.log.Info("ADS stream opening", "xds", path)
	for ctx.Err() == nil {
		err := RunADS(ctx, path, e.Bootstrap.Node, e.onUpdate)
		if ctx.Err() != nil {
			return
		}
		e.log.Warn("ADS stream closed; reconnecting", "xds", path, "err", err)
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
}

// onUpdate counts one ADS response in the stats; once clusters and listeners have
// each been accepted, the server is LIVE and its workers started.
func (e *Envoy) onUpdate(u ADSUpdate) {
	prefix, gauge := "cluster_manager.cds", StatClusters
	if u.Response.TypeURL == TypeListener {
		prefix, gauge = "listener_manager.lds", StatListeners
	}
	names := make([]string, 0, len(u.Response.Resources))
	for _, r := range u.Response.Resources {
		names = append(names, r.Name)
	}
	if u.Err != nil {
		e.Stats.Add(prefix+".update_rejected", 1)
		e.log.Warn("xds update rejected", "type", u.Response.TypeURL, "version", u.Response.VersionInfo, "err", u.Err)
		return
	}
	e.Stats.Add(prefix+".update_success", 1)
	e.Stats.Set(gauge, uint64(len(names)))
	e.log.Info("xds update accepted", "type", u.Response.TypeURL, "version", u.Response.VersionInfo,
		"resources", len(names), "names", strings.Join(firstN(names, 12), ","))
	cds, _ := e.Stats.Get(StatCDSSuccess)
	lds, _ := e.Stats.Get(StatLDSSuccess)
	if st, _ := e.Stats.Get(StatServerState); cds > 0 && lds > 0 && st == StatePreInitializing {
		e.Stats.Set(StatWorkersStarted, 1)
		e.Stats.Set(StatServerState, StateLive)
		e.log.Info("envoy stand-in LIVE", "uid", os.Getuid())
	}
}

func firstN(s []string, n int) []string {
	if len(s) > n {
		return append(s[:n:n], fmt.Sprintf("…(+%d)", len(s)-n))
	}
	return s
}
