package helper

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/spf13/pflag"

	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/flagenv"
	"github.com/meshcni/meshcni/pkg/podget"
)

// Main is meshcni-podget: it GETs one pod (retrying within --timeout) and writes
// one podget.Result as JSON to stdout. It returns the exit status: 0 with the pod, 1
// on failure (the Result says why), 2 on a usage error. It takes every input as a
// flag (the plugin runs it with an empty environment); getenv is read only for
// CNI_COMMAND, to answer a runtime that runs it as a plugin by mistake.
func Main(args []string, stdout, stderr io.Writer, getenv func(string) string) int {
	if getenv("CNI_COMMAND") != "" {
		// Configured as a plugin by mistake: answer in CNI's error format.
		_ = json.NewEncoder(stdout).Encode(map[string]any{
			"cniVersion": "1.0.0", "code": 4,
			"msg": podget.HelperName + " is meshcni's API helper, not a CNI plugin: use \"type\": \"meshcni\"",
		})
		return 1
	}
	fs := pflag.NewFlagSet(podget.HelperName, pflag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: %s --kubeconfig=PATH --namespace=NS --name=POD [--timeout=20s]\n\n"+
			"GETs one pod from the Kubernetes API for the meshcni CNI plugin (which runs it when\n"+
			"meshcni-agent cannot answer) and prints it as JSON. Not meant to be run by hand,\n"+
			"but harmless: it only reads.\n\n", podget.HelperName)
		fs.PrintDefaults()
	}
	kubeconfig := fs.String("kubeconfig", "", "kubeconfig file (absolute path)")
	namespace := fs.String("namespace", "", "pod namespace")
	name := fs.String("name", "", "pod name")
	timeout := fs.Duration("timeout", 20*time.Second, "give up after this long (retrying transport errors, 404, 429 and 5xx)")
	if err := fs.Parse(flagenv.GoStyle(fs, args)); err != nil {
		if errors.Is(err, pflag.ErrHelp) {
			return 0
		}
		return usage(stdout, err)
	}
	switch {
	case fs.NArg() > 0:
		return usage(stdout, fmt.Errorf("unexpected arguments %q", fs.Args()))
	case *kubeconfig == "":
		return usage(stdout, errors.New("--kubeconfig is required"))
	case *namespace == "" || *name == "":
		return usage(stdout, errors.New("--namespace and --name are required"))
	case *timeout <= 0 || *timeout > podget.MaxTimeout:
		return usage(stdout, fmt.Errorf("--timeout %s: want more than 0 and at most %s", *timeout, podget.MaxTimeout))
	}
	r := Request{Kubeconfig: *kubeconfig, Namespace: *namespace, Name: *name, Timeout: *timeout}.Do(context.Background())
	if err := json.NewEncoder(stdout).Encode(r); err != nil {
		fmt.Fprintf(stderr, "%s: write result: %v\n", podget.HelperName, err)
		return 1
	}
	if r.Error != "" {
		return 1
	}
	return 0
}

func usage(stdout io.Writer, err error) int {
	_ = json.NewEncoder(stdout).Encode(podget.Result{Kind: podget.KindUsage, Error: err.Error()})
	return 2
}

// Request is the helper's work: one pod, through one kubeconfig, within Timeout.
type Request struct {
	Kubeconfig, Namespace, Name string
	Timeout                     time.Duration
	// Backoff is the first retry delay (0: NewPodClient's default).
	Backoff time.Duration
}

// Do loads the kubeconfig and GETs the pod; every outcome is a Result.
func (q Request) Do(ctx context.Context) podget.Result {
	cfg, err := LoadKubeconfig(q.Kubeconfig)
	if err != nil {
		return podget.Result{Kind: podget.KindKubeconfig, Error: err.Error()}
	}
	c := NewPodClient(cfg)
	if q.Backoff > 0 {
		c.Backoff = q.Backoff
	}
	ctx, cancel := context.WithTimeout(ctx, q.Timeout)
	defer cancel()
	pod, err := c.GetPod(ctx, q.Namespace, q.Name)
	return result(c.Server(), q.Kubeconfig, pod, err)
}

// result classifies GetPod's outcome for the plugin.
func result(server, kubeconfig string, pod *capture.Pod, err error) podget.Result {
	if err == nil {
		return podget.Result{Server: server, Pod: pod}
	}
	var ae *APIError
	if errors.As(err, &ae) {
		return podget.Result{Server: server, Kind: podget.KindAPI, Error: ae.Err.Error(), Status: ae.Status, Attempts: ae.Attempts}
	}
	var ce *credentialError
	if errors.As(err, &ce) {
		return podget.Result{Server: server, Kind: podget.KindKubeconfig, Error: fmt.Sprintf("kubeconfig %s: %v", kubeconfig, ce.err)}
	}
	return podget.Result{Server: server, Kind: podget.KindDecode, Error: err.Error()}
}
