package traffic

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/internal/standin/proxysim"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
)

// EnvProxysim names a prebuilt meshcni-proxysim binary to use instead of building one.
const EnvProxysim = "MESHCNI_PROXYSIM"

var (
	buildMu    sync.Mutex
	buildPaths = map[string]string{} // main package → binary
	buildDir   string
)

// ProxysimBinary returns the path of a meshcni-proxysim binary executable by any UID:
// $MESHCNI_PROXYSIM, or one built once per test binary.
func ProxysimBinary(t testing.TB) string {
	t.Helper()
	if p := os.Getenv(EnvProxysim); p != "" {
		return p
	}
	return binary(t, "./hack/proxysim", "meshcni-proxysim")
}

// Binary returns a build of the module's main package pkg (e.g. "./cmd/meshcnictl")
// that any UID can execute (built once per test binary, static, in a 0755 directory
// under the temporary directory), for a test that runs it as UID 1337 in a netns.
func Binary(t testing.TB, pkg string) string {
	t.Helper()
	return binary(t, pkg, filepath.Base(pkg))
}

func binary(t testing.TB, pkg, name string) string {
	t.Helper()
	gobin := testutil.RequireBinary(t, "go")
	buildMu.Lock()
	defer buildMu.Unlock()
	if p, ok := buildPaths[pkg]; ok {
		return p
	}
	p, err := build(gobin, pkg, name)
	if err != nil {
		t.Fatalf("build %s: %v", pkg, err)
	}
	buildPaths[pkg] = p
	return p
}

const buildDirPrefix = "meshcni-proxysim."

// build compiles pkg as name into this process's build directory (made on first use).
func build(gobin, pkg, name string) (string, error) {
	root, err := testutil.RepoRoot()
	if err != nil {
		return "", err
	}
	if buildDir == "" {
		removeStaleBuilds()
		dir := filepath.Join(os.TempDir(), buildDirPrefix+strconv.Itoa(os.Getpid()))
		if err := os.RemoveAll(dir); err != nil {
			return "", err
		}
		if err := os.Mkdir(dir, 0o755); err != nil {
			return "", err
		}
		if err := os.Chmod(dir, 0o755); err != nil { // umask-proof: UID 1337 must traverse it
			return "", err
		}
		buildDir = dir
	}
	out := filepath.Join(buildDir, name)
	cmd := exec.Command(gobin, "build", "-o", out, pkg)
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build: %w: %s", err, b)
	}
	if err := os.Chmod(out, 0o755); err != nil {
		return "", err
	}
	return out, nil
}

// removeStaleBuilds deletes build directories of test binaries that are gone.
func removeStaleBuilds() {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), buildDirPrefix+"*"))
	for _, d := range dirs {
		pid, err := strconv.Atoi(strings.TrimPrefix(filepath.Base(d), buildDirPrefix))
		if err != nil || pid == os.Getpid() {
			continue
		}
		if err := unix.Kill(pid, 0); errors.Is(err, unix.ESRCH) {
			_ = os.RemoveAll(d)
		}
	}
}

// ProxyOptions configures StartProxy.
type ProxyOptions struct {
	// Cred is the proxy's identity; nil means ProxyCred (UID/GID 1337). With TPROXY,
	// CAP_NET_ADMIN is added.
	Cred *Cred
	// Args are extra meshcni-proxysim flags, e.g. "--mode=forward", "--dns-port=15053".
	Args []string
	// TPROXY passes --tproxy and grants CAP_NET_ADMIN (IP_TRANSPARENT).
	TPROXY bool
	// ReadyTimeout bounds the wait for the "ready" record (default 10s).
	ReadyTimeout time.Duration
}

// Proxy is a meshcni-proxysim child process running in a namespace.
type Proxy struct {
	NetNS string
	Cred  Cred
	Cmd   *exec.Cmd

	mu      sync.Mutex
	cond    *sync.Cond
	records []proxysim.Record
	exited  bool
	exitErr error
	stderr  *lockedBuffer
}

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// StartProxy starts meshcni-proxysim inside the namespace (as UID/GID 1337 unless
// opts.Cred says otherwise), waits until its listeners are bound and stops it when the
// test ends.
func StartProxy(t testing.TB, nsPath string, opts ProxyOptions) *Proxy {
	t.Helper()
	bin := ProxysimBinary(t)
	cred := ProxyCred
	if opts.Cred != nil {
		cred = *opts.Cred
	}
	args := append([]string{"serve"}, opts.Args...)
	if opts.TPROXY {
		args = append(args, "--tproxy")
		cred.NetAdmin = true
	}
	if opts.ReadyTimeout <= 0 {
		opts.ReadyTimeout = 10 * time.Second
	}
	p := &Proxy{NetNS: nsPath, Cred: cred, stderr: &lockedBuffer{}}
	p.cond = sync.NewCond(&p.mu)
	cmd := exec.Command(bin, args...)
	// A plain pipe (not StdoutPipe): Wait runs concurrently with the reader, and the
	// reader sees EOF only once the child is gone, so no record is lost.
	stdout, pw, err := os.Pipe()
	if err != nil {
		t.Fatalf("proxysim stdout: %v", err)
	}
	cmd.Stdout = pw
	cmd.Stderr = p.stderr
	p.Cmd = cmd
	done, err := StartInNetns(nsPath, cred, cmd)
	pw.Close()
	if err != nil {
		stdout.Close()
		t.Fatalf("start proxysim: %v", err)
	}
	var readers sync.WaitGroup
	readers.Add(1)
	go func() {
		defer readers.Done()
		defer stdout.Close()
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			var r proxysim.Record
			if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
				continue
			}
			p.mu.Lock()
			p.records = append(p.records, r)
			p.cond.Broadcast()
			p.mu.Unlock()
		}
	}()
	go func() {
		err := <-done
		readers.Wait()
		p.mu.Lock()
		p.exited, p.exitErr = true, err
		p.cond.Broadcast()
		p.mu.Unlock()
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(unix.SIGTERM)
		if !p.waitExit(5 * time.Second) {
			_ = cmd.Process.Kill()
			p.waitExit(5 * time.Second)
		}
		if t.Failed() {
			t.Logf("proxysim in %s stderr:\n%s", nsPath, p.stderr.String())
		}
	})
	if _, err := p.Wait(opts.ReadyTimeout, func(r proxysim.Record) bool { return r.Event == proxysim.EventReady }); err != nil {
		t.Fatalf("proxysim not ready: %v\nstderr:\n%s", err, p.stderr.String())
	}
	return p
}

// waitExit waits up to d for the child to exit.
func (p *Proxy) waitExit(d time.Duration) bool {
	deadline := time.Now().Add(d)
	timer := time.AfterFunc(d, func() {
		p.mu.Lock()
		p.cond.Broadcast()
		p.mu.Unlock()
	})
	defer timer.Stop()
	p.mu.Lock()
	defer p.mu.Unlock()
	for !p.exited && time.Now().Before(deadline) {
		p.cond.Wait()
	}
	return p.exited
}

// Wait returns the first record (past or future) matching match, waiting up to d. It
// fails early when the proxy exits.
func (p *Proxy) Wait(d time.Duration, match func(proxysim.Record) bool) (proxysim.Record, error) {
	deadline := time.Now().Add(d)
	timer := time.AfterFunc(d, func() {
		p.mu.Lock()
		p.cond.Broadcast()
		p.mu.Unlock()
	})
	defer timer.Stop()
	p.mu.Lock()
	defer p.mu.Unlock()
	seen := 0
	for {
		for ; seen < len(p.records); seen++ {
			if match(p.records[seen]) {
				return p.records[seen], nil
			}
		}
		if p.exited {
			return proxysim.Record{}, fmt.Errorf("proxysim exited (%v) before a matching record", p.exitErr)
		}
		if !time.Now().Before(deadline) {
			return proxysim.Record{}, fmt.Errorf("no matching record within %v (%d records)", d, len(p.records))
		}
		p.cond.Wait()
	}
}

// WaitRecord is Wait that fails the test.
func (p *Proxy) WaitRecord(t testing.TB, d time.Duration, match func(proxysim.Record) bool) proxysim.Record {
	t.Helper()
	r, err := p.Wait(d, match)
	if err != nil {
		t.Fatalf("proxysim in %s: %v\nstderr:\n%s", p.NetNS, err, p.stderr.String())
	}
	return r
}

// Records returns every record seen so far (the ready record included).
func (p *Proxy) Records() []proxysim.Record {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]proxysim.Record(nil), p.records...)
}

// Stderr returns the proxy's log so far.
func (p *Proxy) Stderr() string { return p.stderr.String() }
