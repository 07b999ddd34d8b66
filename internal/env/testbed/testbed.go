package testbed

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// Mode says which components run.
type Mode string

const (
	// ModeFull runs etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
	// containerd and kubelet: a schedulable node.
	ModeFull Mode = "full"
	// ModeAPIOnly runs etcd and kube-apiserver only.
	ModeAPIOnly Mode = "api-only"
)

// Options configure Start.
type Options struct {
	// APIOnly starts only etcd and kube-apiserver.
	APIOnly bool
	// Conflist is the CNI configuration written to CNIConfDir before containerd
	// starts; DefaultConflist() when nil. WriteConflist changes it later.
	Conflist []byte
	// ImageArchives are extra docker/OCI archives imported into containerd's
	// k8s.io namespace before the kubelet starts.
	ImageArchives []string
	// Binaries overrides Lookup (mostly for tests of the harness itself).
	Binaries *Binaries
	// Timeout bounds the start-up; 2 minutes when zero.
	Timeout time.Duration
	// Logger receives progress; slog.Default() when nil.
	Logger *slog.Logger
	// Shared marks a test bed other processes may use (what `hack/testbed up`
	// runs): their Start fails with ErrRunning and Attach connects to it. A test
	// bed started without it is exclusive: other processes' Start waits for its
	// Stop (LockFile).
	Shared bool
	// Nodes is how many nodes run (full mode): node 1 (NodeName) on the host and
	// Nodes-1 extra nodes named NodeName-2, NodeName-3, …, started in parallel
	// once node 1 is Ready. 0 means 1.
	Nodes int
	// NodeMonitorGracePeriod is the controller-manager's --node-monitor-grace-period:
	// how long a node may go without a heartbeat before it is NotReady (and its pods,
	// through their tolerations, evicted). Zero keeps Kubernetes' default (50 s).
	NodeMonitorGracePeriod time.Duration
	// APIServerArgs are extra kube-apiserver flags, after the test bed's own (a later
	// flag wins), e.g. a --runtime-config taking an API out of discovery.
	APIServerArgs []string
}

// ErrRunning is returned by Start when another process runs a shared test bed
// (`hack/testbed up`); Attach connects to it.
var ErrRunning = errors.New("a test bed is already running")

// Testbed is a running single-node cluster.
type Testbed struct {
	// Mode is what runs.
	Mode Mode
	// Binaries are the binaries in use.
	Binaries Binaries
	// RESTConfig and Client are admin credentials (system:masters).
	RESTConfig *rest.Config
	Client     kubernetes.Interface
	// StartupTime is how long Start took once it held LockFile (waiting for
	// other users of the test bed excluded).
	StartupTime time.Duration

	log    *slog.Logger
	owned  bool
	shared bool
	// nodeGrace is Options.NodeMonitorGracePeriod.
	nodeGrace time.Duration
	mu        sync.Mutex // guards comps and nodes
	comps     []*component
	nodes     []*Node // extra nodes, in order of joining
	control   io.Closer
	lock      *os.File
	stopOnce  sync.Once
	stopErr   error
}

// state is persisted in RunDir/state.json while a test bed runs.
type state struct {
	OwnerPID   int          `json:"ownerPID"`
	Mode       Mode         `json:"mode"`
	Shared     bool         `json:"shared"`
	Ready      bool         `json:"ready"`
	Started    time.Time    `json:"started"`
	Components []stateEntry `json:"components"`
	Nodes      []nodeState  `json:"nodes,omitempty"`
}

type stateEntry struct {
	Name string `json:"name"`
	PID  int    `json:"pid"`
}

func readState() (*state, error) {
	b, err := os.ReadFile(stateFile)
	if err != nil {
		return nil, err
	}
	var s state
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, fmt.Errorf("parse %s: %w", stateFile, err)
	}
	return &s, nil
}

// Running reports the shared test bed (`hack/testbed up`) run by another live
// process, if any: the one Attach connects to.
func Running() (mode Mode, ownerPID int, ok bool) {
	s, err := readState()
	if err != nil || !s.Ready || !s.Shared || s.OwnerPID == os.Getpid() || !pidAlive(s.OwnerPID) {
		return "", 0, false
	}
	return s.Mode, s.OwnerPID, true
}

// Busy reports a test bed, shared or exclusive, starting or running, owned by
// another live process.
func Busy() (ownerPID int, shared, ok bool) {
	s, err := readState()
	if err != nil || s.OwnerPID == os.Getpid() || !pidAlive(s.OwnerPID) {
		return 0, false, false
	}
	return s.OwnerPID, s.Shared, true
}

// Kubeconfig is the path of the admin kubeconfig.
func (tb *Testbed) Kubeconfig() string { return adminKubeconfig }

// Owned reports whether this process started the test bed (false when attached).
func (tb *Testbed) Owned() bool { return tb.owned }

// Start brings up a test bed and returns when it is usable: the API server ready
// and, in full mode, the node Ready, the default ServiceAccount present and the
// pause and echo images imported. It fails with ErrRunning when another process
// runs one, waits while another test binary holds LockFile, and cleans up what a
// crashed test bed left behind. On failure it tears down what it started and the
// error carries the tail of the failing component's log.
func Start(ctx context.Context, opts Options) (tb *Testbed, err error) {
	log := opts.Logger
	if log == nil {
		log = slog.Default()
	}
	if os.Geteuid() != 0 {
		return nil, errors.New("testbed: needs root")
	}
	timeout := opts.Timeout
	if timeout == 0 {
		timeout = 2 * time.Minute
	}
	var bins Binaries
	if opts.Binaries != nil {
		bins = *opts.Binaries
	} else if bins, err = Lookup(); err != nil {
		return nil, err
	}
	mode := ModeFull
	if opts.APIOnly {
		mode = ModeAPIOnly
	}
	if mode == ModeFull && !auxBuilt(bins) {
		root, err := RepoRoot()
		if err != nil {
			return nil, err
		}
		if err := ensureAux(ctx, log, root, bins); err != nil {
			return nil, err
		}
	}

	lock, err := acquireLock(ctx, log)
	if err != nil {
		return nil, err
	}
	tb = &Testbed{Mode: mode, Binaries: bins, log: log, owned: true, lock: lock, shared: opts.Shared, nodeGrace: opts.NodeMonitorGracePeriod}
	began := time.Now()
	defer func() {
		if err != nil {
			log.Error("test bed start failed; tearing down", "err", err)
			_ = tb.Stop(context.WithoutCancel(ctx))
			tb = nil
		}
	}()
	if err := cleanup(ctx, log); err != nil {
		return tb, fmt.Errorf("clean up a previous test bed: %w", err)
	}
	if err := checkPorts(mode); err != nil {
		return tb, err
	}
	startReaper()

	sctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if err := tb.start(sctx, opts); err != nil {
		return tb, err
	}
	if err := tb.startNodes(sctx, opts.Nodes); err != nil {
		return tb, err
	}
	if opts.Shared {
		if tb.control, err = serveControl(tb); err != nil {
			return tb, err
		}
	}
	if err := tb.writeState(true); err != nil {
		return tb, err
	}
	tb.StartupTime = time.Since(began)
	log.Info("test bed ready", "mode", mode, "took", tb.StartupTime.Round(time.Millisecond), "kubeconfig", adminKubeconfig)
	return tb, nil
}

// Attach connects to a test bed run by another process (e.g. `hack/testbed up`).
// Stop on an attached test bed does nothing.
func Attach(ctx context.Context) (*Testbed, error) {
	mode, _, ok := Running()
	if !ok {
		return nil, errors.New("testbed: none running")
	}
	tb := &Testbed{Mode: mode, log: slog.Default()}
	if b, err := Lookup(); err == nil {
		tb.Binaries = b
	}
	if err := tb.connect(); err != nil {
		return nil, err
	}
	if err := tb.waitAPI(ctx); err != nil {
		return nil, err
	}
	return tb, nil
}

func acquireLock(ctx context.Context, log *slog.Logger) (*os.File, error) {
	if log == nil {
		log = slog.Default()
	}
	if _, owner, ok := Running(); ok {
		return nil, fmt.Errorf("%w (owner pid %d): use Attach, or run `hack/testbed down`", ErrRunning, owner)
	}
	f, err := os.OpenFile(LockFile, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open lock %s: %w", LockFile, err)
	}
	logged := false
	for {
		if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err == nil {
			return f, nil
		} else if !errors.Is(err, unix.EWOULDBLOCK) {
			f.Close()
			return nil, fmt.Errorf("lock %s: %w", LockFile, err)
		}
		if _, owner, ok := Running(); ok {
			f.Close()
			return nil, fmt.Errorf("%w (owner pid %d): use Attach, or run `hack/testbed down`", ErrRunning, owner)
		}
		if !logged {
			owner, _, _ := Busy()
			log.Info("waiting for another test bed user to finish", "lock", LockFile, "owner", owner)
			logged = true
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, fmt.Errorf("wait for %s: %w", LockFile, ctx.Err())
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func checkPorts(mode Mode) error {
	ports := []int{APIServerPort, EtcdPort, EtcdPeerPort}
	if mode == ModeFull {
		ports = append(ports, KubeletHealthzPort, ControllerManagerPort, SchedulerPort)
	}
	for _, p := range ports {
		ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
		if err != nil {
			return fmt.Errorf("testbed: port 127.0.0.1:%d is in use (a test bed or another program still running? try `hack/testbed down`): %w", p, err)
		}
		ln.Close()
	}
	return nil
}

func (tb *Testbed) writeState(ready bool) error {
	s := state{OwnerPID: os.Getpid(), Mode: tb.Mode, Shared: tb.shared, Ready: ready, Started: time.Now()}
	tb.mu.Lock()
	for _, c := range tb.comps {
		s.Components = append(s.Components, stateEntry{Name: c.name, PID: c.cmd.Process.Pid})
	}
	for _, n := range tb.nodes {
		s.Nodes = append(s.Nodes, n.state())
	}
	tb.mu.Unlock()
	b, err := json.MarshalIndent(s, "", "  ")
	if err != nil {
		return err
	}
	tmp := stateFile + ".tmp"
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return fmt.Errorf("write state: %w", err)
	}
	return os.Rename(tmp, stateFile)
}

func (tb *Testbed) add(c *component) {
	tb.mu.Lock()
	tb.comps = append(tb.comps, c)
	tb.mu.Unlock()
	_ = tb.writeState(false)
}

func (tb *Testbed) comp(name string) *component {
	tb.mu.Lock()
	defer tb.mu.Unlock()
	for _, c := range tb.comps {
		if c.name == name {
			return c
		}
	}
	return nil
}

func (tb *Testbed) start(ctx context.Context, opts Options) error {
	for _, d := range []string{BaseDir, RunDir, LogDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	if err := unix.Mount("tmpfs", RunDir, "tmpfs", 0, "mode=0755,size=4g"); err != nil {
		return fmt.Errorf("mount tmpfs on %s: %w", RunDir, err)
	}
	// Shared, so a pod may mount containerd's netns directory (NetnsDir) with
	// mountPropagation HostToContainer, as the agent's repair does: the kubelet
	// refuses that from a private mount, which the tmpfs is on a host whose / is
	// private (no systemd).
	if err := unix.Mount("", RunDir, "", unix.MS_SHARED|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("make %s a shared mount: %w", RunDir, err)
	}
	for _, d := range []string{etcdDataDir, containerdState, CNIConfDir, CNIBinDir, kubeletDir, containerdRoot, podLogsDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	if err := os.Chmod(etcdDataDir, 0o700); err != nil {
		return err
	}
	if tb.Mode == ModeFull {
		if err := recordHostSysctls(); err != nil {
			return err
		}
		if err := ensureHostBPFFS(); err != nil {
			return err
		}
	}
	if _, err := generatePKI(); err != nil {
		return fmt.Errorf("generate PKI: %w", err)
	}
	if err := tb.connect(); err != nil {
		return err
	}

	// Runtime side (containerd, CNI, images) in parallel with etcd + API server.
	runtimeErr := make(chan error, 1)
	if tb.Mode == ModeFull {
		go func() { runtimeErr <- tb.startRuntime(ctx, opts) }()
	} else {
		runtimeErr <- nil
	}

	etcd, err := startComponent("etcd", "etcd",
		"--name=testbed", "--data-dir="+etcdDataDir,
		"--listen-client-urls=http://127.0.0.1:"+strconv.Itoa(EtcdPort),
		"--advertise-client-urls=http://127.0.0.1:"+strconv.Itoa(EtcdPort),
		"--listen-peer-urls=http://127.0.0.1:"+strconv.Itoa(EtcdPeerPort),
		"--initial-advertise-peer-urls=http://127.0.0.1:"+strconv.Itoa(EtcdPeerPort),
		"--initial-cluster=testbed=http://127.0.0.1:"+strconv.Itoa(EtcdPeerPort),
		"--snapshot-count=100000", "--quota-backend-bytes=2147483648", "--log-level=warn")
	if err != nil {
		return err
	}
	tb.add(etcd)
	if err := waitFor(ctx, etcd, "etcd healthy", func() error {
		return httpOK(ctx, nil, fmt.Sprintf("http://127.0.0.1:%d/health", EtcdPort))
	}); err != nil {
		return err
	}

	apiserver, err := startComponent("kube-apiserver", tb.Binaries.Path("kube-apiserver"), append(apiserverArgs(), opts.APIServerArgs...)...)
	if err != nil {
		return err
	}
	tb.add(apiserver)
	if err := waitFor(ctx, apiserver, "kube-apiserver ready", func() error {
		_, err := tb.Client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
		return err
	}); err != nil {
		return err
	}
	tb.log.Info("kube-apiserver ready")
	// The controller-manager and scheduler start once the API server is ready (its
	// RBAC bootstrap done: they exit when they cannot read their configuration).
	var cm, sched *component
	if tb.Mode == ModeFull {
		cmArgs := []string{"--kubeconfig=" + filepath.Join(BaseDir, "controller-manager.kubeconfig"),
			"--authentication-kubeconfig=" + filepath.Join(BaseDir, "controller-manager.kubeconfig"),
			"--authorization-kubeconfig=" + filepath.Join(BaseDir, "controller-manager.kubeconfig"),
			"--bind-address=127.0.0.1", "--secure-port=" + strconv.Itoa(ControllerManagerPort),
			"--cert-dir=" + filepath.Join(BaseDir, "controller-manager"),
			"--leader-elect=false", "--use-service-account-credentials=false",
			"--service-account-private-key-file=" + pkiPath("sa.key"),
			"--root-ca-file=" + pkiPath("ca.crt"),
			"--cluster-signing-cert-file=" + pkiPath("ca.crt"), "--cluster-signing-key-file=" + pkiPath("ca.key"),
			"--cluster-name=meshcni-testbed", "--allocate-node-cidrs=false",
			"--service-cluster-ip-range=" + ServiceCIDR, "--v=1"}
		if tb.nodeGrace > 0 {
			cmArgs = append(cmArgs, "--node-monitor-grace-period="+tb.nodeGrace.String())
		}
		cm, err = startComponent("kube-controller-manager", tb.Binaries.Path("kube-controller-manager"), cmArgs...)
		if err != nil {
			return err
		}
		tb.add(cm)
		sched, err = startComponent("kube-scheduler", tb.Binaries.Path("kube-scheduler"),
			"--kubeconfig="+filepath.Join(BaseDir, "scheduler.kubeconfig"),
			"--authentication-kubeconfig="+filepath.Join(BaseDir, "scheduler.kubeconfig"),
			"--authorization-kubeconfig="+filepath.Join(BaseDir, "scheduler.kubeconfig"),
			"--bind-address=127.0.0.1", "--secure-port="+strconv.Itoa(SchedulerPort),
			"--cert-dir="+filepath.Join(BaseDir, "scheduler"),
			"--leader-elect=false", "--v=1")
		if err != nil {
			return err
		}
		tb.add(sched)
	}
	if tb.Mode == ModeAPIOnly {
		return nil
	}

	if err := <-runtimeErr; err != nil {
		return err
	}

	kubelet, err := startComponent("kubelet", tb.Binaries.Path("kubelet"),
		"--config="+filepath.Join(BaseDir, "kubelet.yaml"),
		"--kubeconfig="+filepath.Join(BaseDir, "kubelet.kubeconfig"),
		"--root-dir="+kubeletDir, "--cert-dir="+filepath.Join(kubeletDir, "pki"),
		"--hostname-override="+NodeName, "--node-ip="+NodeIP, "--v=1")
	if err != nil {
		return err
	}
	tb.add(kubelet)
	if err := waitFor(ctx, kubelet, "node Ready", func() error {
		n, err := tb.Client.CoreV1().Nodes().Get(ctx, NodeName, metav1.GetOptions{})
		if err != nil {
			return err
		}
		for _, c := range n.Status.Conditions {
			if c.Type == corev1.NodeReady && c.Status == corev1.ConditionTrue {
				return nil
			}
		}
		return errors.New("node not Ready")
	}); err != nil {
		return err
	}
	tb.log.Info("node ready")
	for _, c := range []*component{cm, sched} {
		if c.exited() {
			return c.failure(errors.New("exited"))
		}
	}
	return waitFor(ctx, cm, "default ServiceAccount", func() error {
		_, err := tb.Client.CoreV1().ServiceAccounts("default").Get(ctx, "default", metav1.GetOptions{})
		return err
	})
}

func apiserverArgs() []string {
	return []string{
		"--etcd-servers=http://127.0.0.1:" + strconv.Itoa(EtcdPort),
		"--bind-address=" + APIServerHost, "--secure-port=" + strconv.Itoa(APIServerPort),
		"--advertise-address=" + APIServerHost, "--endpoint-reconciler-type=none",
		"--tls-cert-file=" + pkiPath("apiserver.crt"), "--tls-private-key-file=" + pkiPath("apiserver.key"),
		"--client-ca-file=" + pkiPath("ca.crt"),
		"--kubelet-client-certificate=" + pkiPath("apiserver-kubelet-client.crt"),
		"--kubelet-client-key=" + pkiPath("apiserver-kubelet-client.key"),
		"--kubelet-preferred-address-types=InternalIP",
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file=" + pkiPath("sa.pub"),
		"--service-account-signing-key-file=" + pkiPath("sa.key"),
		"--service-cluster-ip-range=" + ServiceCIDR,
		"--authorization-mode=Node,RBAC",
		"--allow-privileged=true",
		// Admission webhooks (Istio's injector) are called at their Service's
		// endpoints: there is no kube-proxy to route a ClusterIP.
		"--enable-aggregator-routing=true",
		"--cert-dir=" + filepath.Join(BaseDir, "apiserver"),
		"--profiling=false",
		"--v=1",
	}
}

// startRuntime creates the bridge, installs the CNI plugins and configuration,
// starts containerd and imports the images.
func (tb *Testbed) startRuntime(ctx context.Context, opts Options) error {
	if err := createBridge(); err != nil {
		return err
	}
	for name := range cniPlugins {
		if err := InstallCNIPlugin(filepath.Join(tb.Binaries.CNIPluginDir(), name), name); err != nil {
			return err
		}
	}
	conf := opts.Conflist
	if conf == nil {
		conf = DefaultConflist()
	}
	if err := WriteConflist(conf); err != nil {
		return err
	}
	if err := os.WriteFile(containerdConfigPath, []byte(containerdConfig()), 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(BaseDir, "kubelet.yaml"), []byte(kubeletConfig()), 0o644); err != nil {
		return err
	}
	cd, err := startComponent("containerd", "containerd", "--config="+containerdConfigPath, "--log-level=info")
	if err != nil {
		return err
	}
	tb.add(cd)
	if err := waitFor(ctx, cd, "containerd", func() error {
		out, err := exec.CommandContext(ctx, "ctr", "--address", containerdSocket, "version").CombinedOutput()
		if err != nil {
			return fmt.Errorf("%w: %s", err, out)
		}
		return nil
	}); err != nil {
		return err
	}
	archives := append([]string{tb.Binaries.ImagesArchive()}, opts.ImageArchives...)
	for _, a := range archives {
		if err := ImportImage(ctx, a); err != nil {
			return err
		}
	}
	tb.log.Info("containerd ready, images imported")
	return nil
}

// ImportImage imports a docker or OCI archive into the test bed's containerd (the
// k8s.io namespace the kubelet uses). Pods then use the image with
// imagePullPolicy: Never (or IfNotPresent with a non-latest tag).
// With several nodes it imports into every node's containerd, and nodes that join
// later import it too.
func ImportImage(ctx context.Context, archive string) error {
	if err := importInto(ctx, containerdSocket, archive); err != nil {
		return err
	}
	recordImport(archive)
	for _, n := range runningNodes() {
		if err := importInto(ctx, n.criSocket(), archive); err != nil {
			return fmt.Errorf("node %s: %w", n.Name, err)
		}
	}
	return nil
}

func importInto(ctx context.Context, sock, archive string) error {
	out, err := exec.CommandContext(ctx, "ctr", "--address", sock, "-n", "k8s.io",
		"images", "import", archive).CombinedOutput()
	if err != nil {
		return fmt.Errorf("import image archive %s: %w: %s", archive, err, strings.TrimSpace(string(out)))
	}
	return nil
}

func createBridge() error {
	if l, err := netlink.LinkByName(BridgeName); err == nil {
		_ = netlink.LinkDel(l)
	}
	br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: BridgeName}}
	if err := netlink.LinkAdd(br); err != nil {
		return fmt.Errorf("create bridge %s: %w", BridgeName, err)
	}
	addr, err := netlink.ParseAddr(NodeIP + "/16")
	if err != nil {
		return err
	}
	if err := netlink.AddrAdd(br, addr); err != nil {
		return fmt.Errorf("address %s on %s: %w", addr, BridgeName, err)
	}
	if err := netlink.LinkSetUp(br); err != nil {
		return fmt.Errorf("bring up %s: %w", BridgeName, err)
	}
	return nil
}

func (tb *Testbed) connect() error {
	cfg, err := clientcmd.BuildConfigFromFlags("", adminKubeconfig)
	if err != nil {
		return fmt.Errorf("load kubeconfig: %w", err)
	}
	cfg.QPS, cfg.Burst = 100, 200
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return fmt.Errorf("client: %w", err)
	}
	tb.RESTConfig, tb.Client = cfg, cs
	return nil
}

func (tb *Testbed) waitAPI(ctx context.Context) error {
	return poll(ctx, 100*time.Millisecond, func() error {
		_, err := tb.Client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
		return err
	})
}

// waitFor polls check until it succeeds, the component exits (error with its log
// tail) or ctx ends.
func waitFor(ctx context.Context, c *component, what string, check func() error) error {
	var last error
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		if last = check(); last == nil {
			return nil
		}
		if c.exited() {
			return c.failure(fmt.Errorf("exited while waiting for %s (%v)", what, c.err))
		}
		select {
		case <-ctx.Done():
			return c.failure(fmt.Errorf("waiting for %s: %w (last: %v)", what, ctx.Err(), last))
		case <-t.C:
		}
	}
}

// poll runs check until it returns nil, an errStop (returned unwrapped) or ctx ends.
func poll(ctx context.Context, every time.Duration, check func() error) error {
	var last error
	for {
		if last = check(); last == nil {
			return nil
		}
		var stop errStop
		if errors.As(last, &stop) {
			return stop.error
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w (last: %v)", ctx.Err(), last)
		case <-time.After(every):
		}
	}
}

func httpOK(ctx context.Context, client *http.Client, url string) error {
	if client == nil {
		client = http.DefaultClient
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", url, resp.Status)
	}
	return nil
}

// Stop tears the test bed down in order (controller-manager and scheduler, kubelet,
// pods through the runtime, containerd, API server, etcd), then removes every
// trace: processes, mounts, network namespaces, the bridge, the kubepods cgroups
// and the state directories (logs stay in LogDir). It is a no-op for an attached
// test bed and safe to call twice.
func (tb *Testbed) Stop(ctx context.Context) error {
	if tb == nil || !tb.owned {
		return nil
	}
	tb.stopOnce.Do(func() {
		began := time.Now()
		var errs []error
		if tb.control != nil {
			_ = tb.control.Close()
		}
		errs = append(errs, tb.stopNodes(ctx))
		var wg sync.WaitGroup
		for _, n := range []string{"kube-controller-manager", "kube-scheduler", "kubelet"} {
			if c := tb.comp(n); c != nil {
				wg.Go(func() { c.stop(10 * time.Second) })
			}
		}
		wg.Wait()
		if c := tb.comp("containerd"); c != nil && !c.exited() {
			if err := removePods(ctx, tb.log); err != nil {
				errs = append(errs, err)
			}
		}
		for _, n := range []string{"containerd", "kube-apiserver", "etcd"} {
			if c := tb.comp(n); c != nil {
				c.stop(10 * time.Second)
			}
		}
		if err := cleanup(ctx, tb.log); err != nil {
			errs = append(errs, err)
		}
		if tb.lock != nil {
			_ = unix.Flock(int(tb.lock.Fd()), unix.LOCK_UN)
			tb.lock.Close()
		}
		tb.stopErr = errors.Join(errs...)
		tb.log.Info("test bed stopped", "took", time.Since(began).Round(time.Millisecond), "err", tb.stopErr)
	})
	return tb.stopErr
}

// removePods removes every pod sandbox through CRI. If CNI DEL fails (a test left a
// broken configuration) it restores the default configuration and retries.
func removePods(ctx context.Context, log *slog.Logger) error {
	return removePodsAt(ctx, log, containerdSocket, CNIConfDir, DefaultConflist())
}

// removePodsAt removes every pod sandbox of the containerd at sock; on a CNI DEL
// failure it writes conf into confDir and retries.
func removePodsAt(ctx context.Context, log *slog.Logger, sock, confDir string, conf []byte) error {
	cri, err := dialCRIAt(sock)
	if err != nil {
		return err
	}
	defer cri.Close()
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if err := cri.removeAll(ctx); err != nil {
		if confDir == "" {
			return fmt.Errorf("remove pods: %w", err)
		}
		log.Warn("removing pods failed; retrying with the default CNI configuration", "err", err)
		if werr := writeConflistIn(confDir, conf); werr != nil {
			return errors.Join(err, werr)
		}
		if err := cri.removeAll(ctx); err != nil {
			return fmt.Errorf("remove pods: %w", err)
		}
	}
	return nil
}

// Down stops the test bed run by another process and removes every trace; it is
// what `hack/testbed down` does and also cleans up after a crash. A shared test
// bed (hack/testbed up) is asked to stop (SIGTERM to its owner). A test bed in
// use by a live test process is left alone with an error unless force is set, in
// which case its owner is sent SIGTERM. Down is idempotent: with nothing running
// it only checks.
func Down(ctx context.Context, log *slog.Logger, force bool) error {
	if log == nil {
		log = slog.Default()
	}
	if pid, shared, ok := Busy(); ok {
		if !shared && !force {
			return fmt.Errorf("testbed: in use by test process %d (use force / `hack/testbed down --force` to stop it)", pid)
		}
		log.Info("asking the test bed's owner to stop", "pid", pid, "shared", shared)
		_ = unix.Kill(pid, unix.SIGTERM)
		deadline := time.Now().Add(90 * time.Second)
		for pidAlive(pid) && time.Now().Before(deadline) {
			time.Sleep(100 * time.Millisecond)
		}
	}
	lctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	lock, err := acquireLock(lctx, log)
	if err != nil {
		return err
	}
	defer func() {
		_ = unix.Flock(int(lock.Fd()), unix.LOCK_UN)
		lock.Close()
	}()
	return cleanup(ctx, log)
}

// IsRunning reports whether this test bed is up and owned by this process.
func (tb *Testbed) IsRunning() bool {
	if tb == nil {
		return false
	}
	for _, c := range tb.comps {
		if c.exited() {
			return false
		}
	}
	return true
}

// ignoreNotFound drops a NotFound API error.
func ignoreNotFound(err error) error {
	if apierrors.IsNotFound(err) {
		return nil
	}
	return err
}

// startNodes adds the extra nodes of a test bed of total nodes, in parallel.
func (tb *Testbed) startNodes(ctx context.Context, total int) error {
	if total <= 1 {
		return nil
	}
	if tb.Mode != ModeFull {
		return errors.New("testbed: nodes need a full test bed")
	}
	if total > MaxNodes {
		return fmt.Errorf("testbed: at most %d nodes", MaxNodes)
	}
	errc := make(chan error, total-1)
	for k := 2; k <= total; k++ {
		go func() {
			_, err := tb.addNode(ctx, fmt.Sprintf("%s-%d", NodeName, k), k, NodeOptions{})
			errc <- err
		}()
	}
	var errs []error
	for k := 2; k <= total; k++ {
		errs = append(errs, <-errc)
	}
	return errors.Join(errs...)
}

// stopNodes stops every extra node's daemons (in parallel) and removes its
// traces; Stop then stops node 1 and the control plane.
func (tb *Testbed) stopNodes(ctx context.Context) error {
	tb.mu.Lock()
	nodes := tb.nodes
	tb.nodes = nil
	tb.mu.Unlock()
	errc := make(chan error, len(nodes))
	for _, n := range nodes {
		go func() {
			n.stopProcesses(ctx)
			errc <- teardownNode(n.plan)
		}()
	}
	var errs []error
	for range nodes {
		errs = append(errs, <-errc)
	}
	return errors.Join(errs...)
}
