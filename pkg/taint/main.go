package taint

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os/signal"
	"syscall"

	"github.com/spf13/pflag"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/meshcni/meshcni/pkg/buildinfo"
	"github.com/meshcni/meshcni/pkg/buildinfo/buildmetrics"
	"github.com/meshcni/meshcni/pkg/logformat"
)

// Main is meshcni-taint-controller's main: it parses args and the environment, runs the
// controller until SIGTERM or SIGINT, and returns the exit code (0: stopped by a signal
// or --help, 2: bad settings, 1: failure, including a lost Lease). It is MainVersion
// of a build without a version ("dev").
func Main(args []string, getenv func(string) string, stderr io.Writer) int {
	return MainVersion("", args, getenv, stderr)
}

// MainVersion is Main for the binary's version (its main.version), in
// meshcni_build_info.
func MainVersion(version string, args []string, getenv func(string) string, stderr io.Writer) int {
	cfg, err := ParseFlags(args, getenv, stderr)
	if errors.Is(err, pflag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", Component, err)
		return 2
	}
	log := logformat.New(stderr, cfg.LogLevel, cfg.LogFormat) // client-go's own logs (leader election) too
	rc, err := restConfig(cfg.Kubeconfig)
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", Component, err)
		return 2
	}
	cs, err := kubernetes.NewForConfig(rc)
	if err != nil {
		fmt.Fprintf(stderr, "%s: kubernetes client: %v\n", Component, err)
		return 2
	}
	c, err := New(cs, cfg, log)
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", Component, err)
		return 2
	}
	build := buildinfo.New(version)
	c.Metrics.Registry.MustRegister(buildmetrics.Collector(build))
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	serveErr := make(chan error, 1)
	if cfg.HealthAddr != "" {
		go func() {
			err := c.Serve(ctx, cfg.HealthAddr, log)
			if err != nil {
				cancel()
			}
			serveErr <- err
		}()
	} else {
		close(serveErr)
	}
	log.Info("starting", "agentNamespace", cfg.AgentNamespace, "agentSelector", cfg.AgentSelector.String(),
		"nodeSelector", cfg.NodeSelector.String(), "gracePeriod", cfg.GracePeriod.String(), "taintNewNodes", cfg.TaintNewNodes,
		"leaderElect", cfg.LeaderElect, "identity", cfg.Identity, "version", build.Version)
	runErr := c.Run(ctx)
	cancel()
	if err := <-serveErr; err != nil {
		log.Error("stopped", "err", err.Error())
		return 1
	}
	if runErr != nil {
		log.Error("stopped", "err", runErr.Error())
		return 1
	}
	log.Info("stopped")
	return 0
}

func restConfig(kubeconfig string) (*rest.Config, error) {
	var rc *rest.Config
	var err error
	if kubeconfig != "" {
		if rc, err = clientcmd.BuildConfigFromFlags("", kubeconfig); err != nil {
			return nil, fmt.Errorf("--kubeconfig %s: %w", kubeconfig, err)
		}
	} else if rc, err = rest.InClusterConfig(); err != nil {
		return nil, fmt.Errorf("not in a cluster and no --kubeconfig: %w", err)
	}
	rc.UserAgent = Component
	return rc, nil
}
