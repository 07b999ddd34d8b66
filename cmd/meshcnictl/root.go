package main

import (
	"errors"
	"fmt"
	"os"

	"github.com/spf13/cobra"
)

// exitError carries a process exit code through cobra.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

// subcommands register themselves here from their own files (rules.go, validate.go, ...).
var subcommands []func() *cobra.Command

func newRoot() *cobra.Command {
	root := &cobra.Command{
		Use:   "meshcnictl",
		Short: "Check and operate meshcni's sidecar traffic redirect",
		Long: `meshcnictl is meshcni's command line for operators and for pods:

  precheck         before and during a switch between Istio's istio-cni and meshcni:
                   would any pod be left unredirected (cluster-wide, read-only)
  version          meshcnictl's version and the agent's on each node
  explain POD      whether meshcni redirects a pod, why, and with which rules
  inspect POD      a pod's live rules on this node, compared with the desired ones
  rules            render, apply, check or remove redirect rules by hand
  validate         prove the redirect works, from inside a pod (istio-validation)
  istio-iptables   Istio's proxy-init command line, served by meshcni`,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	for _, f := range subcommands {
		root.AddCommand(f())
	}
	return root
}

func run(args []string) int {
	root := newRoot()
	root.SetArgs(args)
	if err := root.Execute(); err != nil {
		if !errors.Is(err, errReported) {
			fmt.Fprintf(os.Stderr, "meshcnictl: %v\n", err)
		}
		var ee *exitError
		if errors.As(err, &ee) {
			return ee.code
		}
		return 1
	}
	return 0
}
