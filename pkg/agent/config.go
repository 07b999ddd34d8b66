package agent

import (
	"fmt"
	"io"
	"log/slog"
	"net"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/pflag"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/meshcni/meshcni/pkg/audit"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/cniconf"
	"github.com/meshcni/meshcni/pkg/flagenv"
	"github.com/meshcni/meshcni/pkg/heal"
	"github.com/meshcni/meshcni/pkg/install"
	"github.com/meshcni/meshcni/pkg/logformat"
	"github.com/meshcni/meshcni/pkg/podget"
	"github.com/meshcni/meshcni/pkg/repair"
	"github.com/meshcni/meshcni/pkg/spec"
)

// networkName is a CNI network name as the CNI specification allows it.
var networkName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]*$`)

// KubeconfigName is the plugin kubeconfig's file name in the run directory.
const KubeconfigName = "meshcni-kubeconfig"

// Config is the agent's validated configuration.
type Config struct {
	CNIBinDir          string
	CNIConfDir         string
	CNIConfFileName    string
	Chained            bool
	StandaloneFileName string
	NetworkName        string // the standalone list's network name (what Multus looks up)
	PluginBinary       string
	RunDir             string
	Kubeconfig         string // the agent's own API client; empty: in-cluster
	KubeconfigSource   string // the plugin's kubeconfig source; empty: in-cluster service account
	TokenFile, CAFile  string
	// PluginServiceAccount is the ServiceAccount whose token the plugin gets, minted by
	// the agent (TokenRequest bound to its Node); empty: the agent's own token.
	PluginServiceAccount  string
	PluginTokenExpiration time.Duration
	ExcludeNamespaces     []string
	IPv6                  spec.IPv6Mode // the plugin's ipv6 key; also the repair controller's
	LogLevel              slog.Level
	LogFormat             string // logformat.JSON or logformat.Text
	PluginLogLevel        string
	Backend               string
	HealthAddr            string
	KeepOnExit            KeepMode
	DaemonSetName         string
	Debounce              time.Duration
	Resync                time.Duration
	ConflictThreshold     int
	ConflictWindow        time.Duration
	BackoffMax            time.Duration
	PodName               string
	PodNamespace          string
	NodeName              string
	// MarkRedirected labels pods the plugin redirected (Marker).
	MarkRedirected bool

	// The repair controller's settings (flags and checks in repair.go).
	Repair              bool
	RepairAction        repair.Action
	RepairLabelKey      string
	RepairLabelSelector string
	RepairFieldSelector string
	RepairInitContainer string
	RepairExitCode      int
	RepairMessage       string
	RepairNetnsDirs     []string

	// The audit's settings (flags and checks in audit.go).
	AuditPeriod            time.Duration
	AuditAction            audit.Action
	AuditEscapedAction     audit.Action
	AuditConcurrency       int
	AuditFollowAnnotations bool
	// HealLimits bound the evictions of the audit and the repair controller.
	HealLimits heal.Limits

	// eBPF acceleration (flags in ebpf.go).
	EBPF                  EBPFMode
	EBPFDefault           capture.Acceleration
	EBPFNamespaces        []string
	EBPFAllowedNamespaces []string
	EBPFForceUnavailable  string
	EBPFPinDir            string
	EBPFMountBPFFS        bool
	EBPFCgroup2           string
}

// DefaultPluginServiceAccount is the plugin's ServiceAccount of the chart's release
// "meshcni" (and the plain manifests).
const DefaultPluginServiceAccount = "meshcni-plugin"

// KubeconfigPath is where the plugin's kubeconfig goes.
func (c *Config) KubeconfigPath() string { return filepath.Join(c.RunDir, KubeconfigName) }

// PluginPath is the installed plugin binary.
func (c *Config) PluginPath() string { return filepath.Join(c.CNIBinDir, cniconf.PluginType) }

// Entry is the plugin entry the agent writes.
func (c *Config) Entry() cniconf.PluginEntry {
	return cniconf.PluginEntry{
		Type:              cniconf.PluginType,
		PluginLogLevel:    c.PluginLogLevel,
		CNIAgentRunDir:    c.RunDir,
		ExcludeNamespaces: c.ExcludeNamespaces,
		Backend:           c.Backend,
		Kubernetes:        cniconf.Kubernetes{Kubeconfig: c.KubeconfigPath(), CNIBinDir: c.CNIBinDir},
		AgentPodNamespace: c.PodNamespace,
		IPv6:              c.ipv6Key(),
	}
}

// ipv6Key is the entry's ipv6: empty for the default (istio), so a default entry is the
// one every agent version writes.
func (c *Config) ipv6Key() string {
	if c.IPv6 == spec.IPv6Istio || c.IPv6 == "" {
		return ""
	}
	return string(c.IPv6)
}

// EnvPrefix prefixes the environment variable of every flag: --cni-bin-dir is
// MESHCNI_CNI_BIN_DIR.
const EnvPrefix = "MESHCNI_"

// ParseFlags reads the configuration from args and the environment (getenv): a flag
// beats its variable, which beats the default. Every value is parsed and checked.
func ParseFlags(args []string, getenv func(string) string, usage io.Writer) (*Config, error) {
	c := &Config{}
	fs, finish := c.flagSet(usage)
	if err := flagenv.Parse(fs, EnvPrefix, args, getenv); err != nil {
		return nil, err
	}
	if err := finish(); err != nil {
		return nil, err
	}
	if err := c.validate(); err != nil {
		return nil, err
	}
	return c, nil
}

// FlagSet returns the agent's flags with their defaults, for documentation
// (internal/tools/refdoc).
func FlagSet() *pflag.FlagSet {
	fs, _ := (&Config{}).flagSet(io.Discard)
	return fs
}

// flagSet defines every flag on a new FlagSet bound to c; finish turns the
// string-typed flags into c's fields once the FlagSet is parsed.
func (c *Config) flagSet(usage io.Writer) (fs *pflag.FlagSet, finish func() error) {
	fs = pflag.NewFlagSet("meshcni-agent", pflag.ContinueOnError)
	fs.SetOutput(usage)
	var excl, logLevel, keep, ipv6 string
	fs.StringVar(&c.CNIBinDir, "cni-bin-dir", "/opt/cni/bin", "CNI plugin directory of the node (GKE: /home/kubernetes/bin, k3s: /var/lib/rancher/k3s/data/current/bin)")
	fs.StringVar(&c.CNIConfDir, "cni-conf-dir", "/etc/cni/net.d", "CNI configuration directory of the node (k3s: /var/lib/rancher/k3s/agent/etc/cni/net.d)")
	fs.StringVar(&c.CNIConfFileName, "cni-conf-file-name", "", "primary CNI configuration file to chain into (default: the lexically first valid one, as kubelet picks)")
	fs.BoolVar(&c.Chained, "chained", true, "inject into the primary CNI configuration; false writes a standalone list (Multus, OpenShift)")
	fs.StringVar(&c.StandaloneFileName, "standalone-file-name", "meshcni.conflist", "file name of the standalone list in --cni-conf-dir")
	fs.StringVar(&c.NetworkName, "network-name", "meshcni", "network name of the standalone list, the name Multus finds it by (a NetworkAttachmentDefinition of that name without a config); istio-cni answers the default/istio-cni network Istio's injector requests")
	fs.StringVar(&c.PluginBinary, "plugin-binary", "/opt/meshcni/bin/meshcni", "meshcni plugin binary to install (its API helper "+podget.HelperName+" is installed from the same directory)")
	fs.StringVar(&c.RunDir, "run-dir", "/var/run/meshcni", "run directory shared with the plugin: kubeconfig and agent socket")
	fs.StringVar(&c.Kubeconfig, "kubeconfig", "", "kubeconfig of the agent's own API client (Events, the node's pods); default: the pod's in-cluster service account")
	fs.StringVar(&c.KubeconfigSource, "kubeconfig-source", "", "kubeconfig to give the plugin (outside a pod); default: build one from the pod's service account")
	fs.StringVar(&c.PluginServiceAccount, "plugin-service-account", DefaultPluginServiceAccount, "ServiceAccount (in --pod-namespace) whose token the plugin's kubeconfig holds: the agent mints it through the TokenRequest API, bound to its Node, and renews it; empty (--plugin-service-account=): the agent's own token, which can list every pod (warned at start)")
	fs.DurationVar(&c.PluginTokenExpiration, "plugin-token-expiration", time.Hour, "lifetime requested for the plugin's token (10m to 24h; the API server may shorten it); renewed at 70-80 % of the lifetime granted")
	fs.StringVar(&c.TokenFile, "token-file", install.DefaultTokenFile, "service-account token file (in a pod)")
	fs.StringVar(&c.CAFile, "ca-file", install.DefaultCAFile, "service-account CA file (in a pod)")
	fs.StringVar(&excl, "exclude-namespaces", "kube-system", "comma-separated namespaces whose pods the plugin leaves alone")
	fs.StringVar(&ipv6, "ipv6", string(spec.IPv6Istio), "IPv6 mode of meshed pods, written into the plugin entry (a pod's meshcni.io/ipv6 wins): istio (capture IPv6 only as Istio does: ISTIO_DUAL_STACK or an IPv6-only pod), capture, drop (IPv6 that is not captured is dropped)")
	fs.StringVar(&logLevel, "log-level", "info", "agent log level: debug, info, warn, error")
	fs.StringVar(&c.LogFormat, "log-format", logformat.JSON, "agent "+logformat.Usage)
	fs.StringVar(&c.PluginLogLevel, "plugin-log-level", "info", "plugin log level: debug, info, warn, error")
	fs.StringVar(&c.Backend, "backend", "auto", "plugin redirect backend: auto, nftables, iptables-nft, iptables-legacy (iptables = iptables-nft)")
	fs.StringVar(&c.HealthAddr, "health-addr", "127.0.0.1:9807", "listen address of /healthz, /readyz and /metrics (no authentication: a host-network agent listens on the node's IP, as the chart sets it, or loopback, not every interface)")
	fs.StringVar(&keep, "keep-on-exit", string(KeepAuto), "on exit leave binary, kubeconfig and configuration in place: auto (when --daemonset-name still exists and is not being deleted: an upgrade or restart, not an uninstall), always, never; the flag alone means always")
	fs.Lookup("keep-on-exit").NoOptDefVal = string(KeepAlways)
	fs.StringVar(&c.DaemonSetName, "daemonset-name", "", "the agent's DaemonSet in --pod-namespace, which --keep-on-exit auto reads on exit")
	fs.DurationVar(&c.Debounce, "debounce", 10*time.Millisecond, "wait after a file event before reconciling, to merge bursts")
	fs.DurationVar(&c.Resync, "resync", 30*time.Second, "periodic full reconcile, in case an event was missed")
	fs.IntVar(&c.ConflictThreshold, "conflict-threshold", 5, "re-injections within --conflict-window that mean another writer fights (0: never back off)")
	fs.DurationVar(&c.ConflictWindow, "conflict-window", 10*time.Second, "window of --conflict-threshold")
	fs.DurationVar(&c.BackoffMax, "backoff-max", 30*time.Second, "longest wait between re-injections while fighting")
	fs.StringVar(&c.PodName, "pod-name", "", "the agent's pod (downward API), for Kubernetes Events")
	fs.StringVar(&c.PodNamespace, "pod-namespace", "", "the agent's pod namespace (downward API)")
	fs.StringVar(&c.NodeName, "node-name", "", "the node's name (downward API)")
	fs.BoolVar(&c.MarkRedirected, "mark-redirected", true, "label each pod the plugin redirected "+RedirectedLabel+"="+RedirectedValue+" (one patch per meshed pod start, after its ADD; needs API access and --node-name)")
	finishRepair := c.repairFlags(fs)
	finishAudit := c.auditFlags(fs)
	finishEBPF := c.ebpfFlags(fs)
	return fs, func() error {
		if err := c.LogLevel.UnmarshalText([]byte(logLevel)); err != nil {
			return fmt.Errorf("--log-level %q: want debug, info, warn or error", logLevel)
		}
		if _, err := logformat.Parse("--log-format", c.LogFormat); err != nil {
			return err
		}
		k, err := ParseKeepMode(keep)
		if err != nil {
			return err
		}
		c.KeepOnExit = k
		if c.IPv6, err = spec.ParseIPv6Mode("--ipv6", ipv6); err != nil {
			return err
		}
		c.ExcludeNamespaces = []string{}
		for _, ns := range strings.Split(excl, ",") {
			if ns = strings.TrimSpace(ns); ns != "" {
				c.ExcludeNamespaces = append(c.ExcludeNamespaces, ns)
			}
		}
		if err := finishEBPF(); err != nil {
			return err
		}
		if err := finishRepair(); err != nil {
			return err
		}
		return finishAudit()
	}
}

func (c *Config) validate() error {
	for _, p := range []struct {
		flag, v string
		may     bool // may be empty
	}{
		{"cni-bin-dir", c.CNIBinDir, false},
		{"cni-conf-dir", c.CNIConfDir, false},
		{"plugin-binary", c.PluginBinary, false},
		{"run-dir", c.RunDir, false},
		{"kubeconfig", c.Kubeconfig, true},
		{"kubeconfig-source", c.KubeconfigSource, true},
		{"token-file", c.TokenFile, false},
		{"ca-file", c.CAFile, false},
	} {
		if p.v == "" && p.may {
			continue
		}
		if !filepath.IsAbs(p.v) {
			return fmt.Errorf("--%s %q: want an absolute path", p.flag, p.v)
		}
	}
	for _, p := range []*string{&c.CNIBinDir, &c.CNIConfDir, &c.PluginBinary, &c.RunDir, &c.TokenFile, &c.CAFile} {
		*p = filepath.Clean(*p)
	}
	for _, n := range []struct{ flag, v string }{{"cni-conf-file-name", c.CNIConfFileName}, {"standalone-file-name", c.StandaloneFileName}} {
		if n.v == "" && n.flag == "cni-conf-file-name" {
			continue
		}
		if n.v != filepath.Base(n.v) || strings.HasPrefix(n.v, ".") {
			return fmt.Errorf("--%s %q: want a plain file name", n.flag, n.v)
		}
		ext := filepath.Ext(n.v)
		if ext != ".conf" && ext != ".conflist" && ext != ".json" {
			return fmt.Errorf("--%s %q: want a .conf, .conflist or .json file", n.flag, n.v)
		}
	}
	if !networkName.MatchString(c.NetworkName) {
		return fmt.Errorf("--network-name %q: want a CNI network name (a letter or digit, then letters, digits, _ . -)", c.NetworkName)
	}
	if !c.Chained && filepath.Ext(c.StandaloneFileName) != ".conflist" {
		return fmt.Errorf("--standalone-file-name %q: want a .conflist file", c.StandaloneFileName)
	}
	if _, port, err := net.SplitHostPort(c.HealthAddr); err != nil {
		return fmt.Errorf("--health-addr %q: %w", c.HealthAddr, err)
	} else if n, err := strconv.ParseUint(port, 10, 16); err != nil || (n == 0 && port != "0") {
		return fmt.Errorf("--health-addr %q: bad port", c.HealthAddr)
	}
	for _, d := range []struct {
		flag string
		v    time.Duration
	}{{"debounce", c.Debounce}, {"resync", c.Resync}, {"conflict-window", c.ConflictWindow}, {"backoff-max", c.BackoffMax}} {
		if d.v <= 0 && d.flag != "debounce" || d.v < 0 {
			return fmt.Errorf("--%s %v: want a positive duration", d.flag, d.v)
		}
	}
	if c.PluginServiceAccount != "" {
		if errs := validation.IsDNS1123Subdomain(c.PluginServiceAccount); len(errs) > 0 {
			return fmt.Errorf("--plugin-service-account %q: %s", c.PluginServiceAccount, strings.Join(errs, "; "))
		}
	}
	if err := install.CheckTokenExpiration(c.PluginTokenExpiration); err != nil {
		return fmt.Errorf("--plugin-token-expiration: %w (the API server's minimum; the longest a copy of the plugin's kubeconfig stays valid)", err)
	}
	if c.ConflictThreshold < 0 {
		return fmt.Errorf("--conflict-threshold %d: want 0 or more", c.ConflictThreshold)
	}
	if err := c.Entry().Validate(); err != nil {
		return fmt.Errorf("plugin settings: %w", err)
	}
	return nil
}
