package redirectprobe_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/internal/testkit/traffic"
	"github.com/meshcni/meshcni/pkg/redirectprobe"
)

// The validator must run as the proxy UID, so the tests re-execute this test binary
// (copied where UID 1337 can execute it) in a child mode selected by this variable.
const (
	childEnv     = "MESHCNI_VALIDATE_CHILD"
	childIPv6Env = "MESHCNI_VALIDATE_CHILD_IPV6"
	childTimeout = "MESHCNI_VALIDATE_CHILD_TIMEOUT"
)

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) == "1" {
		os.Exit(child())
	}
	code := m.Run()
	if selfDir != "" {
		_ = os.RemoveAll(selfDir)
	}
	os.Exit(code)
}

func child() int {
	cfg := redirectprobe.DefaultConfig()
	cfg.IPv6 = os.Getenv(childIPv6Env) == "1"
	if d, err := time.ParseDuration(os.Getenv(childTimeout)); err == nil {
		cfg.Timeout = d
	}
	if err := redirectprobe.Run(context.Background(), cfg); err != nil {
		fmt.Fprintln(os.Stderr, err)
		var ve *redirectprobe.Error
		if errors.As(err, &ve) {
			return ve.ExitCode()
		}
		return 1
	}
	fmt.Println("validation passed")
	return 0
}

var (
	selfOnce sync.Once
	selfDir  string
	selfPath string
	selfErr  error
)

// selfCopy copies the test binary into a 0755 directory (go test's work directory is
// private to root).
func selfCopy(t *testing.T) string {
	t.Helper()
	selfOnce.Do(func() {
		exe, err := os.Executable()
		if err != nil {
			selfErr = err
			return
		}
		if selfDir, selfErr = os.MkdirTemp("", "meshcni-validate-test-"); selfErr != nil {
			return
		}
		if selfErr = os.Chmod(selfDir, 0o755); selfErr != nil {
			return
		}
		selfPath = filepath.Join(selfDir, "validate.test")
		selfErr = copyFile(exe, selfPath)
	})
	if selfErr != nil {
		t.Fatalf("copy test binary: %v", selfErr)
	}
	return selfPath
}

func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o755)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// runValidator runs the validator in the namespace as cred and returns its exit code,
// output and duration.
func runValidator(t *testing.T, nsPath string, cred traffic.Cred, ipv6 bool, timeout time.Duration) (int, string, time.Duration) {
	t.Helper()
	cmd := exec.Command(selfCopy(t))
	cmd.Env = append(os.Environ(), childEnv+"=1", childTimeout+"="+timeout.String())
	if ipv6 {
		cmd.Env = append(cmd.Env, childIPv6Env+"=1")
	}
	start := time.Now()
	out, err := traffic.RunCmdInNetns(nsPath, cred, timeout+10*time.Second, cmd)
	return traffic.ExitCode(err), fmt.Sprintf("%s %v", out, err), time.Since(start)
}

// rule is one iptables-nft command (nat table) for IPv4 (and IPv6 with v6 addresses).
type rule []string

// istioRules is the minimal subset of Istio's nat rules that the validation depends
// on, written for one family: the proxy UID's traffic to a loopback address other than
// the host's goes to the inbound capture port; app traffic goes to the outbound port.
func istioRules(v6 bool) []rule {
	lo, six := "127.0.0.1/32", "127.0.0.6/32"
	if v6 {
		lo, six = "::1/128", "::6/128"
	}
	rules := []rule{
		{"-N", "ISTIO_REDIRECT"},
		{"-A", "ISTIO_REDIRECT", "-p", "tcp", "-j", "REDIRECT", "--to-ports", "15001"},
		{"-N", "ISTIO_IN_REDIRECT"},
		{"-A", "ISTIO_IN_REDIRECT", "-p", "tcp", "-j", "REDIRECT", "--to-ports", "15006"},
		{"-N", "ISTIO_OUTPUT"},
		{"-A", "OUTPUT", "-p", "tcp", "-j", "ISTIO_OUTPUT"},
		{"-A", "ISTIO_OUTPUT", "-s", six, "-o", "lo", "-j", "RETURN"},
		{"-A", "ISTIO_OUTPUT", "!", "-d", lo, "-o", "lo", "-m", "owner", "--uid-owner", "1337", "-j", "ISTIO_IN_REDIRECT"},
		{"-A", "ISTIO_OUTPUT", "-o", "lo", "-m", "owner", "!", "--uid-owner", "1337", "-j", "RETURN"},
		{"-A", "ISTIO_OUTPUT", "-m", "owner", "--uid-owner", "1337", "-j", "RETURN"},
		{"-A", "ISTIO_OUTPUT", "-d", lo, "-j", "RETURN"},
		{"-A", "ISTIO_OUTPUT", "-j", "ISTIO_REDIRECT"},
	}
	if v6 {
		// Unlike 127.0.0.0/8, only ::1/128 is local: ::6 follows the default route out
		// of eth0, where the -o lo rules do not look. Catch the proxy UID's ::6 there.
		extra := rule{"-I", "ISTIO_OUTPUT", "2", "-d", six, "-m", "owner", "--uid-owner", "1337", "-j", "ISTIO_IN_REDIRECT"}
		rules = append(rules, extra)
	}
	return rules
}

// without drops the rules containing every given word.
func without(rules []rule, words ...string) []rule {
	var out []rule
	for _, r := range rules {
		joined := " " + strings.Join(r, " ") + " "
		drop := true
		for _, w := range words {
			if !strings.Contains(joined, " "+w+" ") {
				drop = false
			}
		}
		if !drop {
			out = append(out, r)
		}
	}
	return out
}

func replace(rules []rule, from, to string) []rule {
	var out []rule
	for _, r := range rules {
		n := make(rule, len(r))
		for i, w := range r {
			n[i] = strings.ReplaceAll(w, from, to)
		}
		out = append(out, n)
	}
	return out
}

func apply(t *testing.T, nsPath string, v6 bool, rules []rule) {
	t.Helper()
	for _, r := range rules {
		traffic.Iptables(t, nsPath, v6, append([]string{"-t", "nat"}, r...)...)
	}
}

func TestValidatorInPod(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "iptables-nft")
	testutil.RequireBinary(t, "ip6tables-nft")
	const failTimeout = 1500 * time.Millisecond
	tests := []struct {
		name     string
		v4, v6   []rule // rules written in the pod (nil: none)
		ipv6     bool   // validate IPv6 too
		cred     traffic.Cred
		listen15 bool // something listens on port 15002 (must not fool the validator)
		wantCode int
	}{
		{name: "istio rules ipv4", v4: istioRules(false), cred: traffic.ProxyCred, wantCode: 0},
		{name: "istio rules dual stack", v4: istioRules(false), v6: istioRules(true), ipv6: true, cred: traffic.ProxyCred, wantCode: 0},
		{name: "istio rules with a listener on 15002", v4: istioRules(false), cred: traffic.ProxyCred, listen15: true, wantCode: 0},
		{name: "no rules", cred: traffic.ProxyCred, wantCode: redirectprobe.ExitCode},
		{name: "no rules, a listener on 15002", cred: traffic.ProxyCred, listen15: true, wantCode: redirectprobe.ExitCode},
		{name: "no proxy-uid loopback redirect, a listener on 15002", v4: without(istioRules(false), "ISTIO_OUTPUT", "ISTIO_IN_REDIRECT"), cred: traffic.ProxyCred, listen15: true, wantCode: redirectprobe.ExitCode},
		{name: "chains not hooked into OUTPUT", v4: without(istioRules(false), "OUTPUT", "ISTIO_OUTPUT", "-p"), cred: traffic.ProxyCred, wantCode: redirectprobe.ExitCode},
		{name: "inbound redirect to the wrong port", v4: replace(istioRules(false), "15006", "15009"), cred: traffic.ProxyCred, wantCode: redirectprobe.ExitCode},
		{name: "ipv4 only rules, ipv6 validated", v4: istioRules(false), ipv6: true, cred: traffic.ProxyCred, wantCode: redirectprobe.ExitCode},
		{name: "validator not run as the proxy uid", v4: istioRules(false), cred: traffic.Root, listen15: true, wantCode: redirectprobe.ExitCode},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			pod := traffic.NewPod(t)
			if tc.listen15 {
				traffic.StartApp(t, pod.NetNS, netip.MustParseAddrPort("[::]:15002"), "impostor")
			}
			apply(t, pod.NetNS, false, tc.v4)
			apply(t, pod.NetNS, true, tc.v6)
			timeout := redirectprobe.DefaultTimeout
			if tc.wantCode != 0 {
				timeout = failTimeout
			}
			code, out, took := runValidator(t, pod.NetNS, tc.cred, tc.ipv6, timeout)
			t.Logf("exit %d after %v: %s", code, took.Round(time.Millisecond), strings.TrimSpace(out))
			if code != tc.wantCode {
				t.Fatalf("exit code %d, want %d", code, tc.wantCode)
			}
			if code != 0 {
				if took > timeout+2*time.Second {
					t.Fatalf("failed after %v, timeout was %v", took, timeout)
				}
				if !strings.Contains(out, "validation failed") {
					t.Fatalf("failure without a clear message: %s", out)
				}
			}
		})
	}
}

// Run creates its sockets on the calling thread, so it works from a thread inside the
// pod's namespace (here as root, with an owner-free rule).
func TestRunInProcess(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "iptables-nft")
	pod := traffic.NewPod(t)
	cfg := redirectprobe.DefaultConfig()
	cfg.Timeout = time.Second

	err := traffic.InNetns(pod.NetNS, func() error { return redirectprobe.Run(context.Background(), cfg) })
	var ve *redirectprobe.Error
	if !errors.As(err, &ve) || ve.ExitCode() != redirectprobe.ExitCode {
		t.Fatalf("without rules: want *redirectprobe.Error with exit code 126, got %v", err)
	}
	if ve.Reason != redirectprobe.ReasonNoConnection || ve.Family != "IPv4" || ve.Attempts < 2 {
		t.Fatalf("error %+v: want no-connection on IPv4 after retries", ve)
	}

	traffic.Iptables(t, pod.NetNS, false, "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "-d", "127.0.0.6", "-j", "REDIRECT", "--to-ports", strconv.Itoa(redirectprobe.DefaultInboundPort))
	if err := traffic.InNetns(pod.NetNS, func() error { return redirectprobe.Run(context.Background(), cfg) }); err != nil {
		t.Fatalf("with a redirect: %v", err)
	}
}

// A listener holding the capture port makes validation fail (exit 126), clearly.
func TestCapturePortBusy(t *testing.T) {
	testutil.RequireRoot(t)
	pod := traffic.NewPod(t)
	traffic.StartApp(t, pod.NetNS, netip.MustParseAddrPort("127.0.0.1:15001"), "busy")
	cfg := redirectprobe.DefaultConfig()
	cfg.Timeout = time.Second
	err := traffic.InNetns(pod.NetNS, func() error { return redirectprobe.Run(context.Background(), cfg) })
	var ve *redirectprobe.Error
	if !errors.As(err, &ve) || ve.Reason != redirectprobe.ReasonListen {
		t.Fatalf("want a listen failure, got %v", err)
	}
}

func TestConfigErrors(t *testing.T) {
	tests := []struct {
		name   string
		mutate func(*redirectprobe.Config)
	}{
		{"probe port is the outbound port", func(c *redirectprobe.Config) { c.ProbePort = c.OutboundPort }},
		{"probe port is the inbound port", func(c *redirectprobe.Config) { c.ProbePort = c.InboundPort }},
		{"no probe port", func(c *redirectprobe.Config) { c.ProbePort = 0 }},
		{"no capture port", func(c *redirectprobe.Config) { c.OutboundPort, c.InboundPort = 0, 0 }},
		{"no timeout", func(c *redirectprobe.Config) { c.Timeout = 0 }},
		{"no family", func(c *redirectprobe.Config) { c.IPv4 = false }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := redirectprobe.DefaultConfig()
			tc.mutate(&cfg)
			err := redirectprobe.Run(context.Background(), cfg)
			var ve *redirectprobe.Error
			if !errors.As(err, &ve) || ve.Reason != redirectprobe.ReasonConfig || ve.ExitCode() != 126 {
				t.Fatalf("want a config *Error, got %v", err)
			}
		})
	}
}

func TestErrorMessage(t *testing.T) {
	e := &redirectprobe.Error{
		Reason: redirectprobe.ReasonNotRedirected, Family: "IPv4",
		Probe:     netip.MustParseAddrPort("127.0.0.6:15002"),
		Listeners: []netip.AddrPort{netip.MustParseAddrPort("127.0.0.1:15001"), netip.MustParseAddrPort("127.0.0.1:15006")},
		Timeout:   5 * time.Second, Attempts: 20, Detail: "something else accepted it",
	}
	msg := e.Error()
	for _, want := range []string{"validation failed", "IPv4", "127.0.0.6:15002", "127.0.0.1:15006", "5s", "20 attempts", "something else accepted it", "rules are missing"} {
		if !strings.Contains(msg, want) {
			t.Errorf("message %q lacks %q", msg, want)
		}
	}
}
