// Package podget is how the meshcni CNI plugin reads a pod from the Kubernetes API
// when the node agent cannot answer: it runs the helper binary meshcni-podget
// (cmd/meshcni-podget, whose inside is pkg/podget/helper), installed next to the
// plugin, and reads one JSON Result from its standard output.
//
// Why a second binary: the plugin runs once per pod sandbox for ADD and for DEL, and
// with an agent on the node it never needs the API server. An HTTPS client
// (crypto/tls, crypto/x509, net/http, a YAML parser for the kubeconfig) linked into it
// would make every exec slower and its binary larger (docs/performance.md).
// The helper pays that start-up only on an agent miss, which also needs a TLS
// connection to the API server anyway.
//
// This package links no network client; its subpackage helper is the helper's side.
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
	"syscall"
	"time"

	"github.com/meshcni/meshcni/pkg/capture"
)

// HelperName is the helper binary's file name, in the plugin's directory.
const HelperName = "meshcni-podget"

// Result is what the helper writes to standard output: one JSON object, with Pod on
// success (exit status 0) and Error on failure (exit status 1).
type Result struct {
	// Server is the API server URL from the kubeconfig ("" when the kubeconfig could
	// not be loaded).
	Server string       `json:"server,omitempty"`
	Pod    *capture.Pod `json:"pod,omitempty"`
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
	case 200:
		return "OK"
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

// HelperPath is HelperName in the plugin's CNI bin directory: the directory of the
// path the runtime executed (argv[0], absolute when run from CNI_PATH), which is where
// meshcni-agent installs the two, even when that path is a symlink; else the
// directory of the running executable.
func HelperPath() (string, error) {
	if len(os.Args) > 0 && filepath.IsAbs(os.Args[0]) {
		return filepath.Join(filepath.Dir(os.Args[0]), HelperName), nil
	}
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

// MaxTimeout bounds the helper's --timeout (and the plugin's api_timeout).
const MaxTimeout = 5 * time.Minute

// Bounds on what the plugin reads from the helper: the pod's JSON (the helper reads at
// most 8 MiB of it from the API server) and its error output.
const (
	maxStdout = 16 << 20
	maxStderr = 64 << 10
)

// GetPod runs the helper for namespace/name; the helper retries within ctx's
// deadline and is killed Grace after it. Errors are *APIError, *KubeconfigError or
// *HelperError.
func (g *Getter) GetPod(ctx context.Context, namespace, name string) (*capture.Pod, error) {
	deadline, ok := ctx.Deadline()
	if !ok {
		return nil, &HelperError{Path: g.Helper, Err: errors.New("no deadline for the API request")}
	}
	timeout := time.Until(deadline)
	if timeout < time.Millisecond {
		return nil, &APIError{Server: g.Server(), Err: context.DeadlineExceeded}
	}
	timeout = min(timeout.Truncate(time.Millisecond), MaxTimeout)
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
		"--timeout="+timeout.String())
	cmd.Env = []string{}
	// Killed with the plugin (a runtime that kills the plugin does not leave the
	// helper behind), and Run returns soon after the kill even if something the helper
	// started still holds its output open.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	cmd.WaitDelay = 500 * time.Millisecond
	stdout := &capped{max: maxStdout}
	stderr := &capped{max: maxStderr}
	cmd.Stdout, cmd.Stderr = stdout, stderr
	runErr := cmd.Run()
	switch {
	case runErr != nil && errors.Is(runErr, fs.ErrNotExist):
		return nil, &HelperError{Path: g.Helper, Err: fmt.Errorf("not installed: %w", fs.ErrNotExist)}
	case rctx.Err() != nil:
		return nil, &HelperError{Path: g.Helper, Err: fmt.Errorf("no answer within the API deadline %s and %s of grace; killed", timeout, grace)}
	case stdout.over:
		return nil, &HelperError{Path: g.Helper, Err: fmt.Errorf("answered more than %d bytes", maxStdout)}
	}
	var r Result
	if err := json.Unmarshal(stdout.b.Bytes(), &r); err != nil {
		msg := limit(strings.TrimSpace(stderr.b.String()))
		if runErr != nil {
			return nil, &HelperError{Path: g.Helper, Err: fmt.Errorf("%v: %s", runErr, msg)}
		}
		return nil, &HelperError{Path: g.Helper, Err: fmt.Errorf("unreadable answer (%v); stderr: %s", err, msg)}
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

// capped is a bytes.Buffer that keeps at most max bytes and remembers it was cut.
type capped struct {
	b    bytes.Buffer
	max  int
	over bool
}

func (c *capped) Write(p []byte) (int, error) {
	if room := c.max - c.b.Len(); len(p) > room {
		c.over = true
		c.b.Write(p[:max(room, 0)])
		return len(p), nil
	}
	return c.b.Write(p)
}

// Outcome is the pod of a successful Result, or its failure as an *APIError,
// *KubeconfigError or *HelperError.
func (r *Result) Outcome() (*capture.Pod, error) {
	switch {
	case r.Error == "" && r.Pod != nil:
		return r.Pod, nil
	case r.Kind == KindKubeconfig:
		return nil, &KubeconfigError{Err: errors.New(r.Error)}
	case r.Kind == KindAPI:
		return nil, &APIError{Server: r.Server, Status: r.Status, Err: errors.New(r.Error), Attempts: r.Attempts}
	case r.Kind == KindDecode:
		// The server answered 200 with something that is not a pod.
		return nil, &APIError{Server: r.Server, Status: 200, Err: errors.New(r.Error), Attempts: r.Attempts}
	case r.Error != "":
		return nil, &HelperError{Err: errors.New(r.Error)}
	}
	return nil, &HelperError{Err: errors.New("no pod in its answer")}
}

func limit(s string) string {
	if len(s) > 300 {
		return strings.ToValidUTF8(s[:300], "") + "..."
	}
	if s == "" {
		return "no output"
	}
	return s
}
