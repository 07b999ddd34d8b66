package main

import (
	"testing"
	"time"

	"github.com/spf13/pflag"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/internal/testkit/traffic"
	"github.com/meshcni/meshcni/pkg/redirectprobe"
)

func TestValidateFlags(t *testing.T) {
	istioArgs := []string{"-p", "15001", "-z", "15006", "-u", "1337", "-m", "REDIRECT", "-i", "*", "-x", "",
		"-b", "*", "-d", "15090,15021,15020", "--log_output_level=default:info", "--run-validation", "--skip-rule-apply"}
	tests := []struct {
		name    string
		args    []string
		env     map[string]string
		want    func(*redirectprobe.Config)
		wantErr bool
	}{
		{name: "defaults", want: func(*redirectprobe.Config) {}},
		{name: "istio-validation container args", args: istioArgs, want: func(*redirectprobe.Config) {}},
		{name: "ports and timeout flags", args: []string{"-p", "16001", "-z", "16006", "--iptables-probe-port", "16002", "--probe-timeout", "2s"},
			want: func(c *redirectprobe.Config) {
				c.OutboundPort, c.InboundPort, c.ProbePort, c.Timeout = 16001, 16006, 16002, 2*time.Second
			}},
		{name: "environment", env: map[string]string{"ENVOY_PORT": "17001", "INBOUND_CAPTURE_PORT": "17006", "IPTABLES_PROBE_PORT": "17002", "PROBE_TIMEOUT": "3s", "ISTIO_DUAL_STACK": "true"},
			want: func(c *redirectprobe.Config) {
				c.OutboundPort, c.InboundPort, c.ProbePort, c.Timeout, c.IPv6 = 17001, 17006, 17002, 3*time.Second, true
			}},
		{name: "flag beats environment", args: []string{"-p", "18001"}, env: map[string]string{"ENVOY_PORT": "17001"},
			want: func(c *redirectprobe.Config) { c.OutboundPort = 18001 }},
		{name: "dual stack flag", args: []string{"--dual-stack"}, want: func(c *redirectprobe.Config) { c.IPv6 = true }},
		{name: "ipv6 only", args: []string{"--ipv4=false", "--ipv6"}, want: func(c *redirectprobe.Config) { c.IPv4, c.IPv6 = false, true }},
		{name: "bad port", args: []string{"-p", "99999"}, wantErr: true},
		{name: "bad probe port", args: []string{"--iptables-probe-port", "x"}, wantErr: true},
		{name: "bad timeout", args: []string{"--probe-timeout", "5"}, wantErr: true},
		{name: "negative timeout", args: []string{"--probe-timeout", "-1s"}, wantErr: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			getenv := func(k string) string { return tc.env[k] }
			f := &validateFlags{ignoredBools: map[string]*bool{}}
			fs := pflag.NewFlagSet("validate", pflag.ContinueOnError)
			f.register(fs, getenv)
			if err := fs.Parse(tc.args); err != nil {
				t.Fatalf("parse: %v", err)
			}
			got, err := f.config(getenv)
			if tc.wantErr {
				if err == nil {
					t.Fatalf("want an error, got %+v", got)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			want := redirectprobe.DefaultConfig()
			tc.want(&want)
			if got != want {
				t.Fatalf("config %+v, want %+v", got, want)
			}
		})
	}
}

// The command exits 126 without a redirect and 0 with one (run in-process on a thread
// inside the namespace; as root, so the test rule matches any UID).
func TestValidateCommandExitCodes(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "iptables-nft")
	pod := traffic.NewPod(t)
	runIn := func(args ...string) int {
		var code int
		if err := traffic.InNetns(pod.NetNS, func() error { code = run(args); return nil }); err != nil {
			t.Fatal(err)
		}
		return code
	}
	start := time.Now()
	if code := runIn("validate", "--probe-timeout=1s", "--run-validation"); code != redirectprobe.ExitCode {
		t.Fatalf("without rules: exit %d, want %d", code, redirectprobe.ExitCode)
	}
	if took := time.Since(start); took > 3*time.Second {
		t.Fatalf("failing took %v with a 1s timeout", took)
	}
	if code := runIn("validate", "--probe-timeout", "nonsense"); code != 1 {
		t.Fatalf("bad flag: exit %d, want 1", code)
	}
	traffic.Iptables(t, pod.NetNS, false, "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "-d", "127.0.0.6", "-j", "REDIRECT", "--to-ports", "15006")
	if code := runIn("validate", "--run-validation", "--skip-rule-apply", "-u", "1337"); code != 0 {
		t.Fatalf("with a redirect: exit %d, want 0", code)
	}
}
