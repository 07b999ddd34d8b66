package main

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/meshcni/meshcni/pkg/istioflags"
	"github.com/meshcni/meshcni/pkg/redirectprobe"
	"github.com/meshcni/meshcni/pkg/spec"
)

func init() { subcommands = append(subcommands, newValidateCmd) }

// validateFlags holds the flags validation uses; the rest of istio-iptables' flags are
// accepted (so the istio-validation init container's arguments work unchanged) and
// ignored.
type validateFlags struct {
	istio        *istioflags.Values
	probePort    string
	probeTimeout string
	ipv4, ipv6   bool
	verbose      bool
	ignoredBools map[string]*bool
}

// Istio's validation-related flags and their environment variables.
const (
	envProbePort    = "IPTABLES_PROBE_PORT"
	envProbeTimeout = "PROBE_TIMEOUT"
)

// ignoredBool is an istio-iptables boolean flag a command accepts and ignores.
type ignoredBool struct{ long, short string }

// ignoredBoolFlags and ignoredStringFlags are istio-iptables flags that do not change
// what validation checks.
var (
	ignoredBoolFlags = []ignoredBool{
		{"run-validation", ""}, {"skip-rule-apply", ""}, {"dry-run", "n"},
		{"iptables-trace-logging", ""}, {"restore-format", ""}, {"cni-mode", ""},
		{"reconcile", ""}, {"cleanup-only", ""}, {"force-apply", ""},
		{"native-nftables", ""}, {"force-legacy-iptables", ""}, {"log_as_json", ""},
	}
	ignoredStringFlags = []string{"log_output_level", "network-namespace", "iptables-version", "output-paths"}
)

func newValidateCmd() *cobra.Command {
	f := &validateFlags{ignoredBools: map[string]*bool{}}
	cmd := &cobra.Command{
		Use:   "validate",
		Short: "Prove the sidecar redirect is in place, from inside the pod (validation init container; exit 126 on failure)",
		Long: `validate runs inside the pod's network namespace as the proxy UID (non-root, no
capabilities), like istio-cni's istio-validation init container
("istio-iptables --run-validation"). It listens on the outbound and inbound capture
ports (-p, -z) on 127.0.0.1 (and ::1 with --dual-stack/--ipv6), dials
127.0.0.6:<probe port> ([::6]) and passes only when that connection reaches a capture
listener with SO_ORIGINAL_DST equal to the probe address. It retries until
--probe-timeout and exits 126 on failure.

istio-iptables' flags and environment variables are accepted (ENVOY_PORT,
INBOUND_CAPTURE_PORT, IPTABLES_PROBE_PORT, PROBE_TIMEOUT, ISTIO_DUAL_STACK, ...); the
ones that only shape rules are ignored.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := f.config(os.Getenv)
			if err != nil {
				return err
			}
			level := slog.LevelInfo
			if f.verbose {
				level = slog.LevelDebug
			}
			cfg.Logger = slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), &slog.HandlerOptions{Level: level}))
			if err := redirectprobe.Run(cmd.Context(), cfg); err != nil {
				var ve *redirectprobe.Error
				if errors.As(err, &ve) {
					return &exitError{code: ve.ExitCode(), err: err}
				}
				return &exitError{code: redirectprobe.ExitCode, err: err}
			}
			fmt.Fprintln(cmd.OutOrStdout(), "validation passed: the sidecar redirect is in place")
			return nil
		},
	}
	// Unknown istio-iptables flags of future versions must not break the init container.
	cmd.FParseErrWhitelist.UnknownFlags = true
	fs := cmd.Flags()
	f.register(fs, os.Getenv)
	return cmd
}

func (f *validateFlags) register(fs *pflag.FlagSet, getenv func(string) string) {
	f.istio = istioflags.Register(fs, getenv)
	fs.StringVar(&f.probePort, "iptables-probe-port", envOr(getenv, envProbePort, "15002"),
		"port of the probe destination 127.0.0.6 / ::6 (env "+envProbePort+")")
	fs.StringVar(&f.probeTimeout, "probe-timeout", envOr(getenv, envProbeTimeout, redirectprobe.DefaultTimeout.String()),
		"how long to retry before failing (env "+envProbeTimeout+")")
	fs.BoolVar(&f.ipv4, "ipv4", true, "validate IPv4 (127.0.0.1 / 127.0.0.6)")
	fs.BoolVar(&f.ipv6, "ipv6", false, "validate IPv6 (::1 / ::6) too; implied by --dual-stack")
	fs.BoolVarP(&f.verbose, "verbose", "v", false, "log every step")
	f.ignoredBools = registerIgnored(fs, ignoredBoolFlags, ignoredStringFlags)
}

// registerIgnored adds istio-iptables flags that do not change what the command does,
// hidden, so Istio's command lines parse unchanged.
func registerIgnored(fs *pflag.FlagSet, bools []ignoredBool, strs []string) map[string]*bool {
	m := map[string]*bool{}
	for _, b := range bools {
		p := new(bool)
		m[b.long] = p
		fs.BoolVarP(p, b.long, b.short, false, "accepted for istio-iptables compatibility; ignored")
		_ = fs.MarkHidden(b.long)
	}
	for _, s := range strs {
		fs.String(s, "", "accepted for istio-iptables compatibility; ignored")
		_ = fs.MarkHidden(s)
	}
	return m
}

func envOr(getenv func(string) string, name, def string) string {
	if v := getenv(name); v != "" {
		return v
	}
	return def
}

// config turns the flags into a typed redirectprobe.Config.
func (f *validateFlags) config(_ func(string) string) (redirectprobe.Config, error) {
	cfg := redirectprobe.DefaultConfig()
	var err error
	if cfg.OutboundPort, err = spec.ParsePort("-p/--envoy-port", f.istio.ProxyPort); err != nil {
		return cfg, err
	}
	if cfg.InboundPort, err = spec.ParsePort("-z/--inbound-capture-port", f.istio.InboundCapturePort); err != nil {
		return cfg, err
	}
	if cfg.ProbePort, err = spec.ParsePort("--iptables-probe-port", f.probePort); err != nil {
		return cfg, err
	}
	if cfg.Timeout, err = time.ParseDuration(f.probeTimeout); err != nil || cfg.Timeout <= 0 {
		return cfg, fmt.Errorf("--probe-timeout %q: want a positive duration such as 5s", f.probeTimeout)
	}
	cfg.IPv4 = f.ipv4
	cfg.IPv6 = f.ipv6 || f.istio.DualStack
	return cfg, nil
}
