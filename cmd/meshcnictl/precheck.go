package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/spf13/cobra"

	"github.com/meshcni/meshcni/pkg/meshcnictl/kubeget"
	"github.com/meshcni/meshcni/pkg/meshcnictl/output"
	"github.com/meshcni/meshcni/pkg/meshcnictl/precheck"
)

func init() { subcommands = append(subcommands, newPrecheckCmd) }

// Exit codes of precheck.
const (
	exitBlockers   = 1 // a blocker found
	exitCheckError = 2 // bad flags, the API server unreachable or refusing a list
)

// precheckKind is the kind of precheck's -o json|yaml result.
const precheckKind = "SwitchPrecheck"

type precheckReport struct {
	output.TypeMeta `json:",inline"`
	precheck.Result `json:",inline"`
}

func newPrecheckCmd() *cobra.Command {
	var kubeconfig, outFormat string
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "precheck",
		Short: "Check, cluster-wide and read-only, whether switching between Istio's istio-cni and meshcni would leave a pod unredirected",
		Long: `precheck reads the cluster (nodes, DaemonSets, pods, istiod's injector ConfigMaps,
Multus' NetworkAttachmentDefinitions) and prints one line per finding: its severity
(BLOCKER, WARNING, INFO), what is true and, after "=>", what to do. It tells:

- whether Istio's istio-cni (pods labelled k8s-app=istio-cni-node) and meshcni's agent
  run, and on which nodes they are Ready;
- what each of istiod's injectors (istio-sidecar-injector and its revisions) gives new
  pods: pilot.cni.enabled (istio-validation and the CNI, or the privileged istio-init),
  pilot.cni.provider and the Multus network, the proxy-init image;
- which nodes no CNI redirect covers while the injector relies on one, and whether the
  injector's Multus network matches meshcni's standalone network and exists;
- which meshed pods carry istio-init, and which have no istio-validation.

Run it before and during each step of docs/migration.md. It changes nothing; it needs
list on nodes, daemonsets, pods, configmaps and network-attachment-definitions.

Exit status: 0 without blocker, 1 with a blocker, 2 when the cluster cannot be read.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			format, err := output.ParseFormat(outFormat)
			if err != nil {
				return &exitError{code: exitCheckError, err: err}
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			return runPrecheck(ctx, cmd.OutOrStdout(), kubeconfig, format)
		},
	}
	cmd.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return &exitError{code: exitCheckError, err: err} })
	fl := cmd.Flags()
	fl.StringVar(&kubeconfig, "kubeconfig", os.Getenv("KUBECONFIG"), "kubeconfig of the cluster (default $KUBECONFIG, else the in-cluster service account)")
	fl.StringVarP(&outFormat, "output", "o", "text", "output format: text, json or yaml")
	fl.DurationVar(&timeout, "timeout", 60*time.Second, "give up after this long")
	return cmd
}

func runPrecheck(ctx context.Context, out io.Writer, kubeconfig string, format output.Format) error {
	c, err := kubeget.New(kubeconfig)
	if err != nil {
		return &exitError{code: exitCheckError, err: err}
	}
	in, err := precheck.Collect(ctx, c)
	if err != nil {
		return &exitError{code: exitCheckError, err: fmt.Errorf("read the cluster at %s: %w", c.Host(), err)}
	}
	r := precheck.Run(in)
	if format != output.Text {
		if err := output.Write(out, format, precheckReport{TypeMeta: output.Meta(precheckKind), Result: r}); err != nil {
			return err
		}
	} else {
		for _, f := range r.Findings {
			fmt.Fprintln(out, f)
		}
		fmt.Fprintf(out, "%d blocker(s), %d warning(s)\n", r.Blockers, r.Warnings)
	}
	if r.Blockers > 0 {
		return &exitError{code: exitBlockers, err: fmt.Errorf("%d blocker(s): the switch would leave pods unredirected or unable to start; fix them first", r.Blockers)}
	}
	return nil
}
