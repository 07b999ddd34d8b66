package taint

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"os"
	"strconv"
	"time"

	"github.com/spf13/pflag"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/meshcni/meshcni/pkg/flagenv"
	"github.com/meshcni/meshcni/pkg/logformat"
)

// EnvPrefix prefixes the environment variable of every flag: --grace-period is
// MESHCNI_GRACE_PERIOD.
const EnvPrefix = "MESHCNI_"

// DefaultAgentSelector selects the agent DaemonSet's pods.
const DefaultAgentSelector = "app.kubernetes.io/name=meshcni,app.kubernetes.io/component=agent"

// Config is the controller's validated configuration.
type Config struct {
	Kubeconfig     string // empty: in-cluster
	AgentNamespace string
	AgentSelector  labels.Selector
	NodeSelector   labels.Selector // labels.Everything(): every node
	TaintNewNodes  bool
	GracePeriod    time.Duration
	// TaintMode: Joining (the zero value) or Always.
	TaintMode Mode
	// MaxTaintedFraction and MaxTaintedFloor bound the tainted managed nodes: at most
	// Limit(managed, MaxTaintedFraction, MaxTaintedFloor). 1 and 0: no bound; 0 and 0:
	// the controller only removes the taint.
	MaxTaintedFraction float64
	MaxTaintedFloor    int
	Workers            int
	Resync             time.Duration // 0: no periodic re-check

	LeaderElect    bool
	LeaseName      string
	LeaseNamespace string
	Identity       string
	LeaseDuration  time.Duration
	RenewDeadline  time.Duration
	RetryPeriod    time.Duration
	// KeepLeaseOnExit does not release the Lease when Run's context ends, as a crashed
	// process would not: the others take over only once it expires. Tests only; the
	// command always releases.
	KeepLeaseOnExit bool

	HealthAddr string
	LogLevel   slog.Level
	LogFormat  string // logformat.JSON or logformat.Text
}

// Policy is the decision's part of the configuration.
func (c *Config) Policy() Policy {
	return Policy{Grace: c.GracePeriod, TaintNewNodes: c.TaintNewNodes, Mode: c.TaintMode}
}

// ParseFlags reads the configuration from args and the environment (getenv): a flag
// beats its MESHCNI_* variable, which beats the default. POD_NAMESPACE (downward API)
// is the default of --agent-namespace and --lease-namespace. Every value is parsed and
// checked; --help returns pflag.ErrHelp.
func ParseFlags(args []string, getenv func(string) string, usage io.Writer) (*Config, error) {
	c := &Config{}
	fs, finish := c.flagSet(getenv("POD_NAMESPACE"), usage)
	if err := flagenv.Parse(fs, EnvPrefix, args, getenv); err != nil {
		return nil, err
	}
	if err := finish(); err != nil {
		return nil, err
	}
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return c, nil
}

// FlagSet returns the controller's flags with their defaults, for documentation
// (internal/tools/refdoc).
func FlagSet() *pflag.FlagSet {
	fs, _ := (&Config{}).flagSet("", io.Discard)
	return fs
}

// flagSet defines every flag on a new FlagSet bound to c (podNS: the downward API's
// namespace, the default of the namespace flags); finish turns the string-typed
// flags into c's fields once the FlagSet is parsed.
func (c *Config) flagSet(podNS string, usage io.Writer) (fs *pflag.FlagSet, finish func() error) {
	fs = pflag.NewFlagSet("meshcni-taint-controller", pflag.ContinueOnError)
	fs.SetOutput(usage)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), `meshcni-taint-controller puts the taint %s:%s on a node whose meshcni agent
pod has never been Ready there (a joining node; --taint-mode=always: any node whose agent pod
is not Ready), never on more than --max-tainted-fraction of the nodes, and removes it once
the agent pod on that node is Ready. Run it as its own Deployment (2 replicas, leader
election through a Lease); see docs/taint.md.

Usage: meshcni-taint-controller [flags]

Flags (each also read from the environment variable named in brackets):
`, TaintKey, TaintEffect)
		fs.PrintDefaults()
	}
	var agentSel, nodeSel, logLevel, mode string
	fs.StringVar(&c.Kubeconfig, "kubeconfig", "", "kubeconfig of the API client; default: the pod's in-cluster service account")
	fs.StringVar(&c.AgentNamespace, "agent-namespace", podNS, "namespace of the meshcni agent pods (default: $POD_NAMESPACE)")
	fs.StringVar(&agentSel, "agent-selector", DefaultAgentSelector, "label selector of the meshcni agent pods; a pod counts for the node in its spec.nodeName")
	fs.StringVar(&nodeSel, "node-selector", "", "label selector of the nodes to manage; default: every node. Other nodes are never touched")
	fs.BoolVar(&c.TaintNewNodes, "taint-new-nodes", true, "taint a new node (created at most --grace-period before it is first seen) that has no Ready agent pod at once; false: only after --grace-period")
	fs.DurationVar(&c.GracePeriod, "grace-period", 30*time.Second, "how long a node may be without a Ready agent pod before it is tainted (covers a rolling update of the agent)")
	fs.StringVar(&mode, "taint-mode", "joining", "which nodes get the taint: joining (only nodes whose agent pod was never Ready there, remembered in the node annotation "+MarkAnnotation+") or always (any node whose agent pod is not Ready past --grace-period)")
	fs.Float64Var(&c.MaxTaintedFraction, "max-tainted-fraction", 0.1, "never taint more than this fraction of the managed nodes (rounded down, at least --max-tainted-floor): past it the controller adds no taint, reports, and still removes taints (0 to 1; 1: no limit)")
	fs.IntVar(&c.MaxTaintedFloor, "max-tainted-floor", 1, "the limit of tainted nodes is never below this many, so that a small cluster can taint a joining node")
	fs.IntVar(&c.Workers, "workers", 4, "nodes reconciled in parallel")
	fs.DurationVar(&c.Resync, "resync", 10*time.Minute, "re-check every node this often, in case an event was missed (0: never)")
	fs.BoolVar(&c.LeaderElect, "leader-elect", true, "elect one active replica through a Lease; false: act at once (one replica only!)")
	fs.StringVar(&c.LeaseName, "lease-name", "meshcni-taint-controller", "name of the leader-election Lease")
	fs.StringVar(&c.LeaseNamespace, "lease-namespace", podNS, "namespace of the leader-election Lease (default: $POD_NAMESPACE)")
	fs.StringVar(&c.Identity, "identity", "", "this replica's identity in the Lease; default: host name (the pod's name) + a random suffix")
	fs.DurationVar(&c.LeaseDuration, "lease-duration", 15*time.Second, "how long the other replicas wait after the last renewal before taking over a leader that vanished")
	fs.DurationVar(&c.RenewDeadline, "renew-deadline", 10*time.Second, "how long the leader keeps retrying to renew before it gives up leading (and exits)")
	fs.DurationVar(&c.RetryPeriod, "retry-period", 2*time.Second, "interval between tries to acquire or renew the Lease")
	fs.StringVar(&c.HealthAddr, "health-addr", ":9808", "listen address of /healthz, /readyz and /metrics (empty: none)")
	fs.StringVar(&logLevel, "log-level", "info", "log level: debug, info, warn, error")
	fs.StringVar(&c.LogFormat, "log-format", logformat.JSON, logformat.Usage)

	return fs, func() error {
		if err := c.LogLevel.UnmarshalText([]byte(logLevel)); err != nil {
			return fmt.Errorf("--log-level %q: want debug, info, warn or error", logLevel)
		}
		if _, err := logformat.Parse("--log-format", c.LogFormat); err != nil {
			return err
		}
		var err error
		if c.TaintMode, err = ParseMode(mode); err != nil {
			return err
		}
		if c.AgentSelector, err = labels.Parse(agentSel); err != nil {
			return fmt.Errorf("--agent-selector %q: %w", agentSel, err)
		}
		if c.NodeSelector, err = labels.Parse(nodeSel); err != nil {
			return fmt.Errorf("--node-selector %q: %w", nodeSel, err)
		}
		if c.Identity == "" && c.LeaderElect {
			if c.Identity, err = defaultIdentity(); err != nil {
				return err
			}
		}
		return nil
	}
}

func defaultIdentity() (string, error) {
	host, err := os.Hostname()
	if err != nil {
		return "", fmt.Errorf("--identity: no host name: %w", err)
	}
	b := make([]byte, 4)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("--identity: %w", err)
	}
	return host + "_" + hex.EncodeToString(b), nil
}

// Validate checks a configuration (ParseFlags calls it; tests building a Config should).
func (c *Config) Validate() error {
	if c.AgentNamespace == "" {
		return fmt.Errorf("--agent-namespace: empty (set it, or POD_NAMESPACE from the downward API)")
	}
	if errs := validation.IsDNS1123Label(c.AgentNamespace); len(errs) > 0 {
		return fmt.Errorf("--agent-namespace %q: %v", c.AgentNamespace, errs)
	}
	if c.AgentSelector == nil || c.AgentSelector.Empty() {
		return fmt.Errorf("--agent-selector: empty (it would take every pod of %s for an agent)", c.AgentNamespace)
	}
	if c.NodeSelector == nil {
		c.NodeSelector = labels.Everything()
	}
	if c.GracePeriod < 0 {
		return fmt.Errorf("--grace-period %v: want 0 or more", c.GracePeriod)
	}
	if math.IsNaN(c.MaxTaintedFraction) || c.MaxTaintedFraction < 0 || c.MaxTaintedFraction > 1 {
		return fmt.Errorf("--max-tainted-fraction %v: want 0 to 1", c.MaxTaintedFraction)
	}
	if c.MaxTaintedFloor < 0 {
		return fmt.Errorf("--max-tainted-floor %d: want 0 or more", c.MaxTaintedFloor)
	}
	if c.TaintMode != Joining && c.TaintMode != Always {
		return fmt.Errorf("--taint-mode %d: want joining or always", c.TaintMode)
	}
	if c.Resync < 0 {
		return fmt.Errorf("--resync %v: want 0 or more", c.Resync)
	}
	if c.Workers < 1 || c.Workers > 64 {
		return fmt.Errorf("--workers %d: want 1 to 64", c.Workers)
	}
	if c.LeaderElect {
		if errs := validation.IsDNS1123Subdomain(c.LeaseName); len(errs) > 0 {
			return fmt.Errorf("--lease-name %q: %v", c.LeaseName, errs)
		}
		if c.LeaseNamespace == "" {
			return fmt.Errorf("--lease-namespace: empty (set it, or POD_NAMESPACE from the downward API)")
		}
		if errs := validation.IsDNS1123Label(c.LeaseNamespace); len(errs) > 0 {
			return fmt.Errorf("--lease-namespace %q: %v", c.LeaseNamespace, errs)
		}
		if c.Identity == "" {
			return fmt.Errorf("--identity: empty")
		}
		if c.RetryPeriod <= 0 {
			return fmt.Errorf("--retry-period %v: want a positive duration", c.RetryPeriod)
		}
		// client-go's own rules (leaderelection.NewLeaderElector), said with our flags.
		if c.RenewDeadline <= time.Duration(1.2*float64(c.RetryPeriod)) {
			return fmt.Errorf("--renew-deadline %v: want more than 1.2 × --retry-period (%v)", c.RenewDeadline, c.RetryPeriod)
		}
		// The Lease records its duration in whole seconds; a leader writes only within
		// --renew-deadline of a renewal (fence.go), which must end before that.
		if c.LeaseDuration.Truncate(time.Second) <= c.RenewDeadline {
			return fmt.Errorf("--lease-duration %v: want more than --renew-deadline (%v) in whole seconds (the Lease records %ds)",
				c.LeaseDuration, c.RenewDeadline, int(c.LeaseDuration/time.Second))
		}
	}
	if c.HealthAddr != "" {
		if _, port, err := net.SplitHostPort(c.HealthAddr); err != nil {
			return fmt.Errorf("--health-addr %q: %w", c.HealthAddr, err)
		} else if n, err := strconv.ParseUint(port, 10, 16); err != nil || (n == 0 && port != "0") {
			return fmt.Errorf("--health-addr %q: bad port", c.HealthAddr)
		}
	}
	return nil
}
