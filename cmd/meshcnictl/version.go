package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"runtime/debug"
	"strconv"
	"time"

	"github.com/spf13/cobra"
	corev1 "k8s.io/api/core/v1"

	"github.com/meshcni/meshcni/pkg/buildinfo"
	"github.com/meshcni/meshcni/pkg/meshcnictl/agentversion"
	"github.com/meshcni/meshcni/pkg/meshcnictl/kubeget"
	"github.com/meshcni/meshcni/pkg/meshcnictl/output"
	"github.com/meshcni/meshcni/pkg/meshcnictl/precheck"
)

// version is meshcnictl's version, set at build time:
// go build -ldflags "-X main.version=0.3.0" ./cmd/meshcnictl
var version string

func init() { subcommands = append(subcommands, newVersionCmd) }

// versionKind is the kind of version's -o json|yaml result.
const versionKind = "Version"

type versionReport struct {
	output.TypeMeta `json:",inline"`
	Client          buildinfo.Info      `json:"client"`
	Agents          []agentversion.Node `json:"agents,omitempty"`
	// AgentsError says why the agents were not asked ("" when they were).
	AgentsError string `json:"agentsError,omitempty"`
}

// clientVersion is -X main.version, else the module version Go stamped, else "dev"
// (buildinfo.New), as the agent reports its own on GET /version.
func clientVersion() buildinfo.Info {
	v := version
	if bi, ok := debug.ReadBuildInfo(); v == "" && ok && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		v = bi.Main.Version
	}
	return buildinfo.New(v)
}

func newVersionCmd() *cobra.Command {
	var kubeconfig, outFormat string
	var clientOnly bool
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "version",
		Short: "Print meshcnictl's version and the version of meshcni's agent on each node",
		Long: `version prints meshcnictl's own version, then, for each meshcni agent pod (found
by the chart's labels app.kubernetes.io/name=meshcni, app.kubernetes.io/component=agent
in every namespace), its node and the version the agent reports on GET /version of its
health and metrics port, asked through the API server's pods proxy (needs get on
pods/proxy). When the agent does not answer, the version is the tag (or digest) of the
pod's image, with a note saying so.

--client prints meshcnictl's version only, without the cluster.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			format, err := output.ParseFormat(outFormat)
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			r := versionReport{TypeMeta: output.Meta(versionKind), Client: clientVersion()}
			var agentsErr error
			if !clientOnly {
				r.Agents, agentsErr = agentVersions(ctx, kubeconfig)
				if agentsErr != nil {
					r.AgentsError = agentsErr.Error()
				}
			}
			if err := printVersion(cmd.OutOrStdout(), format, r, clientOnly); err != nil {
				return err
			}
			return agentsErr
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&kubeconfig, "kubeconfig", os.Getenv("KUBECONFIG"), "kubeconfig of the cluster (default $KUBECONFIG, else the in-cluster service account)")
	fl.BoolVar(&clientOnly, "client", false, "print meshcnictl's version only")
	fl.StringVarP(&outFormat, "output", "o", "text", "output format: text, json or yaml")
	fl.DurationVar(&timeout, "timeout", 20*time.Second, "give up after this long")
	return cmd
}

// agentVersions finds the agent pods and asks each for its version.
func agentVersions(ctx context.Context, kubeconfig string) ([]agentversion.Node, error) {
	c, err := kubeget.New(kubeconfig)
	if err != nil {
		return nil, err
	}
	pods, err := kubeget.List[corev1.Pod](ctx, c, "api/v1/pods", url.Values{"labelSelector": {precheck.MeshcniAgentSelector()}})
	if err != nil {
		return nil, fmt.Errorf("list meshcni's agent pods at %s: %w", c.Host(), err)
	}
	fetch := func(ctx context.Context, pod *corev1.Pod, port int, path string) ([]byte, error) {
		ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		body, err := c.Raw(ctx, "api/v1/namespaces/"+pod.Namespace+"/pods/"+pod.Name+":"+strconv.Itoa(port)+"/proxy/"+path, nil)
		var se *kubeget.StatusError
		if errors.As(err, &se) {
			return nil, fmt.Errorf("%s: %s", se.Status, se.Message) // the note names the pod and port
		}
		return body, err
	}
	return agentversion.Collect(ctx, pods, fetch), nil
}

func printVersion(out io.Writer, format output.Format, r versionReport, clientOnly bool) error {
	if format != output.Text {
		return output.Write(out, format, r)
	}
	fmt.Fprintf(out, "client: meshcnictl %s (%s, %s)\n", r.Client.Version, r.Client.GoVersion, r.Client.Platform)
	if clientOnly || r.AgentsError != "" {
		return nil
	}
	if len(r.Agents) == 0 {
		fmt.Fprintln(out, "agents: none (no pod labelled "+precheck.MeshcniAgentSelector()+")")
	}
	for _, a := range r.Agents {
		line := fmt.Sprintf("node %s: meshcni-agent %s", a.Node, a.Version)
		if a.Source == agentversion.FromAgent {
			line += fmt.Sprintf(" (%s, %s)", a.GoVersion, a.Platform)
		}
		line += " pod " + a.Pod
		if a.Note != "" {
			line += "; " + a.Note + " " + a.Image
		}
		fmt.Fprintln(out, line)
	}
	return nil
}
