// Package podget is how the meshcni CNI plugin reads a pod from the Kubernetes API
// when the node agent cannot answer: it runs the helper binary meshcni-podget
// (cmd/meshcni-podget, pkg/kubeapi), installed next to the plugin, and reads one JSON
// Result from its standard output.
//
// Why a second binary: the plugin runs once per pod sandbox for ADD and for DEL, and
// with an agent on the node it never needs the API server. Linking an HTTPS client
// (crypto/tls, crypto/x509, net/http, a YAML parser for the kubeconfig) into it made
// every exec ≈ 0.5 ms slower and its binary 8.5 instead of 4.7 MB (docs/plugin.md).
// The helper pays that start-up only on an agent miss, which also needs a TLS
// connection to the API server (several milliseconds) anyway.
//
// This package links no network client; pkg/kubeapi implements the helper's side.
package podget

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/meshcni/meshcni/pkg/podspec"
)

// HelperName is the helper binary's file name, in the plugin's directory.
const HelperName = "meshcni-podget"

// Result is what the helper writes to standard output: one JSON object, with Pod on
// success (exit status 0) and Error on failure (exit status 1).
type Result struct {
	// Server is the API server URL from the kubeconfig ("" when the kubeconfig could
	// not be loaded).
	Server string       `json:"server,omitempty"`
	Pod    *podspec.Pod `json:"pod,omitempty"`
	// Error says what failed; Kind classifies it.
	Error string `json:"error,omitempty"`
	Kind  string `json:"kind,omitempty"`
	// Status is the API server's HTTP status of the last attempt (Kind KindAPI);
	// 0 when the server was not reached.
	Status int `json:"status,omitempty"`
	// Attempts is how many GETs were made.
	Attempts int `json:"attempts,omitempty"`
}

// Failure kinds of a Result.
const (
	KindKubeconfig = "kubeconfig" // the kubeconfig cannot be read or used
	KindAPI        = "api"        // the GET failed (Status says how)
	KindDecode     = "decode"     // the API answered 200 with something that is not a pod
	KindUsage      = "usage"      // the helper was called wrongly
)

// APIError is a failed pod GET, classified for the message the plugin returns.
type APIError struct {
	Server   string // the API server URL
	Status   int    // HTTP status; 0 when the server was not reached
	Err      error  // the transport error, or the server's message
	Attempts int    // GETs made (0: not counted)
}

func (e *APIError) Error() string {
	switch {
	case e.Status == 0:
		return fmt.Sprintf("cannot reach the Kubernetes API at %s: %v", e.Server, e.Err)
	default:
		return fmt.Sprintf("the Kubernetes API at %s answered %d %s: %v", e.Server, e.Status, StatusText(e.Status), e.Err)
	}
}

func (e *APIError) Unwrap() error { return e.Err }

// Retryable reports whether another attempt may succeed: transport errors, 404 (a
// static pod's mirror pod may not exist yet), 429 and 5xx. 401 and 403 are final.
func (e *APIError) Retryable() bool {
	return e.Status == 0 || e.Status == 404 || e.Status == 429 || e.Status >= 500
}

// StatusText names the HTTP statuses the plugin's messages mention (net/http's table
// is not linked here).
func StatusText(code int) string {
	switch code {
	case 400:
		return "Bad Request"
	case 401:
		return "Unauthorized"
	case 403:
		return "Forbidden"
	case 404:
		return "Not Found"
	case 409:
		return "Conflict"
	case 429:
		return "Too Many Requests"
	case 500:
		return "Internal Server Error"
	case 502:
		return "Bad Gateway"
	case 503:
		return "Service Unavailable"
	case 504:
		return "Gateway Timeout"
	}
	return "error"
}

// KubeconfigError: the helper could not load the kubeconfig.
type KubeconfigError struct{ Err error }

func (e *KubeconfigError) Error() string { return e.Err.Error() }
func (e *KubeconfigError) Unwrap() error { return e.Err }

// HelperError: the helper could not be run, or answered something unreadable.
type HelperError struct {
	Path string
	Err  error
}

func (e *HelperError) Error() string {
	if e.Path == "" {
		return "pod helper: " + e.Err.Error()
	}
	return fmt.Sprintf("pod helper %s: %v", e.Path, e.Err)
}
func (e *HelperError) Unwrap() error { return e.Err }

// Getter GETs pods by running the helper.
type Getter struct {
	// Helper is the helper binary's path (HelperPath()).
	Helper string
	// Kubeconfig is the kubeconfig the helper reads.
	Kubeconfig string
	// Grace is how long past the context's deadline the helper may run before it is
	// killed (it stops by itself at the deadline it is given).
	Grace time.Duration

	server string
}

// HelperPath is HelperName in the directory of the running executable (the plugin's
// CNI bin directory).
func HelperPath() (string, error) {
	exe, err := os.Executable()
	if err != nil {
		return "", fmt.Errorf("find the plugin's own path: %w", err)
	}
	return filepath.Join(filepath.Dir(exe), HelperName), nil
}

// Server is the API server URL the last GetPod reported, or a description of where
// it comes from before that.
func (g *Getter) Server() string {
	if g.server != "" {
		return g.server
	}
	return "the server of " + g.Kubeconfig
}

// GetPod runs the helper for namespace/name; the helper retries within ctx's
// deadline. Errors are *APIError, *KubeconfigError, *HelperError, or a decode error.
func (g *Getter) GetPod(ctx context.Context, namespace, name string) (*podspec.Pod, error) {
	deadline, ok := ctx.Deadline()
	if !ok {
		return nil, &HelperError{Path: g.Helper, Err: errors.New("no deadline for the API request")}
	}
	timeout := time.Until(deadline)
	if timeout <= 0 {
		return nil, &APIError{Server: g.Server(), Err: context.DeadlineExceeded}
	}
	grace := g.Grace
	if grace <= 0 {
		grace = 2 * time.Second
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), timeout+grace)
	defer cancel()
	// Fixed argv, no shell, an empty environment; values travel as --flag=value so
	// that none can be read as another flag.
	cmd := exec.CommandContext(rctx, g.Helper,
		"--kubeconfig="+g.Kubeconfig,
		"--namespace="+namespace,
		"--name="+name,
		"--timeout="+timeout.Round(time.Millisecond).String())
	cmd.Env = []string{}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	runErr := cmd.Run()
	if runErr != nil && errors.Is(runErr, fs.ErrNotExist) {
		return nil, &HelperError{Path: g.Helper, Err: fmt.Errorf("not installed (meshcni-agent installs it next to the plugin): %w", fs.ErrNotExist)}
	}
	var r Result
	if err := json.Unmarshal(stdout.Bytes(), &r); err != nil {
		msg := strings.TrimSpace(stderr.String())
		if runErr != nil {
			return nil, &HelperError{Path: g.Helper, Err: fmt.Errorf("%v: %s", runErr, limit(msg))}
		}
		return nil, &HelperError{Path: g.Helper, Err: fmt.Errorf("unreadable answer: %v", err)}
	}
	g.server = r.Server
	pod, err := r.Outcome()
	var he *HelperError
	switch {
	case errors.As(err, &he):
		he.Path = g.Helper
	case err == nil && runErr != nil:
		return nil, &HelperError{Path: g.Helper, Err: fmt.Errorf("answered a pod but failed: %v", runErr)}
	}
	return pod, err
}

// Outcome is the pod of a successful Result, or its failure as an *APIError,
// *KubeconfigError or *HelperError.
func (r *Result) Outcome() (*podspec.Pod, error) {
	switch {
	case r.Error == "" && r.Pod != nil:
		return r.Pod, nil
	case r.Kind == KindKubeconfig:
		return nil, &KubeconfigError{Err: errors.New(r.Error)}
	case r.Kind == KindAPI:
		return nil, &APIError{Server: r.Server, Status: r.Status, Err: errors.New(r.Error), Attempts: r.Attempts}
	case r.Error != "":
		return nil, &HelperError{Err: errors.New(r.Error)}
	}
	return nil, &HelperError{Err: errors.New("no pod in its answer")}
}

func limit(s string) string {
	if len(s) > 300 {
		return s[:300] + "..."
	}
	if s == "" {
		return "no output"
	}
	return s
}
