// Command testbed drives the meshcni test bed (see package testbed); hack/testbed
// builds and runs it.
//
//	testbed build            build and cache the binaries (idempotent)
//	testbed up [--api-only] [--nodes N]
//	                         start a test bed in the background (N nodes)
//	testbed node add NAME    join a node to the running test bed
//	testbed node remove NAME drain and remove it, with every trace
//	testbed down [--force]   stop it and remove every trace (idempotent); --force
//	                         also stops a test bed a running test owns
//	testbed env              print shell exports for `eval "$(hack/testbed env)"`
//	testbed status           say whether one runs
package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"github.com/spf13/pflag"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/pkg/flagenv"
)

func main() {
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	slog.SetDefault(log)
	if len(os.Args) < 2 {
		usage()
	}
	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()
	var err error
	switch os.Args[1] {
	case "build":
		_, err = testbed.Build(ctx, log)
	case "up":
		err = up(ctx, log, os.Args[2:])
	case "serve":
		err = serve(log, os.Args[2:])
	case "node":
		err = node(ctx, os.Args[2:])
	case "down":
		err = testbed.Down(ctx, log, parseDown(os.Args[2:]))
		if err == nil {
			if left := testbed.Leftovers(); len(left) > 0 {
				err = fmt.Errorf("left behind: %v", left)
			}
		}
	case "env":
		err = env()
	case "status":
		if mode, pid, ok := testbed.Running(); ok {
			fmt.Printf("running: mode=%s owner pid=%d kubeconfig=%s\n", mode, pid, testbed.KubeconfigPath())
			printNodes(ctx)
		} else if pid, _, ok := testbed.Busy(); ok {
			fmt.Printf("in use by a test: pid %d\n", pid)
		} else {
			fmt.Println("not running")
			os.Exit(3)
		}
	default:
		usage()
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "testbed %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: testbed build | up [--api-only] [--nodes N] | node add|remove NAME | down [--force] | env | status")
	os.Exit(2)
}

type upFlags struct {
	apiOnly bool
	nodes   int
}

func parseUp(name string, args []string) (upFlags, error) {
	fs := pflag.NewFlagSet(name, pflag.ExitOnError)
	var f upFlags
	fs.BoolVar(&f.apiOnly, "api-only", false, "run etcd and kube-apiserver only")
	fs.IntVar(&f.nodes, "nodes", 1, "how many nodes (each extra node has its own network and mount namespaces; up to 3 on a 2-core machine)")
	_ = fs.Parse(flagenv.GoStyle(fs, args))
	if f.nodes < 1 || f.nodes > testbed.MaxNodes {
		return f, fmt.Errorf("--nodes %d: want 1..%d", f.nodes, testbed.MaxNodes)
	}
	if f.apiOnly && f.nodes > 1 {
		return f, errors.New("--nodes needs a full test bed (not --api-only)")
	}
	return f, nil
}

func parseDown(args []string) bool {
	fs := pflag.NewFlagSet("down", pflag.ExitOnError)
	force := fs.Bool("force", false, "also stop a test bed a running test owns")
	_ = fs.Parse(flagenv.GoStyle(fs, args))
	return *force
}

// up starts `testbed serve` detached (it owns the test bed's processes and reaps
// them) and waits until it reports ready or fails.
func up(ctx context.Context, log *slog.Logger, args []string) error {
	f, err := parseUp("up", args)
	if err != nil {
		return err
	}
	if mode, pid, ok := testbed.Running(); ok {
		return fmt.Errorf("a test bed (%s) is already running, owned by pid %d: run `hack/testbed down` first", mode, pid)
	}
	if pid, _, ok := testbed.Busy(); ok {
		return fmt.Errorf("a test (pid %d) is using the test bed: wait for it to finish, or stop it with `hack/testbed down`", pid)
	}
	if _, err := testbed.Lookup(); err != nil {
		return err
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	if err := os.MkdirAll(testbed.LogDir, 0o755); err != nil {
		return err
	}
	logPath := filepath.Join(testbed.LogDir, "testbed.log")
	lf, err := os.OpenFile(logPath, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	defer lf.Close()
	sargs := []string{"serve", "--nodes", strconv.Itoa(f.nodes)}
	if f.apiOnly {
		sargs = append(sargs, "--api-only")
	}
	cmd := exec.Command(self, sargs...)
	cmd.Stdout, cmd.Stderr = lf, lf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	began := time.Now()
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start supervisor: %w", err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	for {
		if _, pid, ok := testbed.Running(); ok && pid == cmd.Process.Pid {
			log.Info("test bed up", "took", time.Since(began).Round(time.Millisecond), "supervisor", pid, "logs", testbed.LogDir)
			fmt.Printf("export KUBECONFIG=%s\n", testbed.KubeconfigPath())
			return nil
		}
		select {
		case err := <-exited:
			return fmt.Errorf("test bed failed to start (%v); see %s:\n%s", err, logPath, tailFile(logPath))
		case <-ctx.Done():
			_ = cmd.Process.Signal(syscall.SIGTERM)
			<-exited
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// serve runs a test bed in the foreground until SIGTERM/SIGINT.
func serve(log *slog.Logger, args []string) error {
	f, err := parseUp("serve", args)
	if err != nil {
		return err
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	ctx, cancel := context.WithCancel(context.Background())
	go func() { <-sig; cancel() }()
	tb, err := testbed.Start(ctx, testbed.Options{APIOnly: f.apiOnly, Nodes: f.nodes, Logger: log, Shared: true, Timeout: 2 * time.Minute * time.Duration(f.nodes)})
	if err != nil {
		return err
	}
	<-ctx.Done()
	log.Info("stopping test bed")
	return tb.Stop(context.Background())
}

func env() error {
	fmt.Printf("export KUBECONFIG=%s\n", testbed.KubeconfigPath())
	fmt.Printf("export MESHCNI_TESTBED_CNI_CONF_DIR=%s\n", testbed.CNIConfDir)
	fmt.Printf("export MESHCNI_TESTBED_CNI_BIN_DIR=%s\n", testbed.CNIBinDir)
	fmt.Printf("export CONTAINERD_ADDRESS=%s\n", testbed.ContainerdSocket())
	fmt.Printf("export CONTAINERD_NAMESPACE=k8s.io\n")
	if b, err := testbed.Lookup(); err == nil {
		fmt.Printf("export PATH=%s:$PATH\n", b.K8sDir)
	} else if !errors.Is(err, testbed.ErrNotBuilt) {
		return err
	}
	if _, _, ok := testbed.Running(); !ok {
		fmt.Println("# no test bed is running: hack/testbed up")
	}
	return nil
}

func tailFile(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	return string(b)
}

// node adds or removes a node of the running shared test bed (its owner does it).
func node(ctx context.Context, args []string) error {
	if len(args) != 2 || (args[0] != "add" && args[0] != "remove") {
		return errors.New("usage: testbed node add|remove NAME")
	}
	tb, err := testbed.Attach(ctx)
	if err != nil {
		return fmt.Errorf("%w (start one with `hack/testbed up`)", err)
	}
	if args[0] == "remove" {
		n, err := tb.Node(args[1])
		if err != nil {
			return err
		}
		return n.Remove(ctx)
	}
	began := time.Now()
	n, err := tb.AddNode(ctx, args[1])
	if err != nil {
		return err
	}
	slog.Info("node ready", "node", n.Name, "ip", n.IP, "podCIDR", n.PodCIDR,
		"startup", n.StartupTime.Round(time.Millisecond), "took", time.Since(began).Round(time.Millisecond))
	return nil
}

func printNodes(ctx context.Context) {
	tb, err := testbed.Attach(ctx)
	if err != nil {
		return
	}
	for _, n := range tb.Nodes() {
		fmt.Printf("node %s ip=%s podCIDR=%s\n", n.Name, n.IP, n.PodCIDR)
	}
}
