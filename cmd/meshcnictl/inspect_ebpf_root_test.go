package main

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"strings"
	"testing"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/agentsock"
	"github.com/meshcni/meshcni/pkg/ebpf/sockmap"
)

func TestEBPFState(t *testing.T) {
	cookie := func(string) (uint64, error) { return 42, nil }
	for _, tc := range []struct {
		name             string
		cookieOf         func(string) (uint64, error)
		resp             *agentsock.EBPFResponse
		err              error
		wantState        string
		wantReasonSubstr string
	}{
		{"accelerated", cookie, &agentsock.EBPFResponse{Available: true, Accelerated: true}, nil, "accelerated", ""},
		{"not on the list", cookie, &agentsock.EBPFResponse{Available: true}, nil, "not accelerated", "not on the agent's acceleration allow-list"},
		{"agent off", cookie, &agentsock.EBPFResponse{Reason: "off"}, nil, "not accelerated", "has not loaded eBPF acceleration: off"},
		{"no agent", cookie, nil, errors.New("dial: no such file"), "unknown: ask meshcni's agent: dial: no such file", ""},
		{"no cookie", func(string) (uint64, error) { return 0, errors.New("SO_NETNS_COOKIE (Linux 5.14): bad") }, nil, nil, "unknown: SO_NETNS_COOKIE (Linux 5.14): bad", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var asked uint64
			ask := func(_ context.Context, c uint64) (*agentsock.EBPFResponse, error) { asked = c; return tc.resp, tc.err }
			state, reason := ebpfState(context.Background(), "/x", tc.cookieOf, ask)
			if state != tc.wantState || !strings.Contains(reason, tc.wantReasonSubstr) || (tc.wantReasonSubstr == "") != (reason == "") {
				t.Errorf("ebpfState = %q, %q; want %q, reason with %q", state, reason, tc.wantState, tc.wantReasonSubstr)
			}
			if tc.resp != nil && asked != 42 {
				t.Errorf("asked for cookie %d, want 42", asked)
			}
		})
	}
}

// serveEBPF serves RequestEBPF on a real agent socket in a fresh run dir: a cookie
// in accel is accelerated.
func serveEBPF(t *testing.T, accel map[uint64]bool) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "mcni-ctl-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	s := &agentsock.Server{Path: agentsock.Path(dir), OnRequest: func(_ context.Context, req *agentsock.Request) (json.RawMessage, error) {
		if req.Type != agentsock.RequestEBPF {
			return nil, agentsock.ErrUnsupported
		}
		var r agentsock.EBPFRequest
		if err := json.Unmarshal(req.Body, &r); err != nil {
			return nil, err
		}
		return json.Marshal(agentsock.EBPFResponse{Available: true, Accelerated: accel[r.NetnsCookie]})
	}}
	l, err := agentsock.Listen(s.Path)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = s.ServeListener(ctx, l) }()
	t.Cleanup(func() { cancel(); <-done })
	return dir
}

// TestInspectEBPF: inspect sends the cookie of the namespace it reads to the agent's
// socket (--agent-run-dir) and prints its answer; without an agent, "unknown".
func TestInspectEBPF(t *testing.T) {
	testutil.RequireRoot(t)
	on, off := testutil.NewNetns(t), testutil.NewNetns(t)
	c, err := sockmap.NetnsCookie(on)
	if err != nil {
		t.Fatal(err)
	}
	dir := serveEBPF(t, map[uint64]bool{c: true})
	for _, tc := range []struct {
		netns, runDir, want string
	}{
		{on, dir, "ebpf:     accelerated\n"},
		{off, dir, "ebpf:     not accelerated; not on the agent's acceleration allow-list\n"},
		{on, t.TempDir() + "/none", "ebpf:     unknown: ask meshcni's agent: socket in "},
	} {
		out, code, err := ctl(t, "inspect", "--agent-run-dir", tc.runDir, tc.netns)
		if code != 0 || err != nil || !strings.Contains(out, tc.want) {
			t.Errorf("inspect %s (run dir %s): exit %d, %v; want %q in:\n%s", tc.netns, tc.runDir, code, err, tc.want, out)
		}
	}
	out, _, _ := ctl(t, "inspect", "--agent-run-dir", dir, "-o", "json", on)
	var r inspectReport
	if err := json.Unmarshal([]byte(out), &r); err != nil || r.EBPF != ebpfAccelerated || r.EBPFReason != "" {
		t.Fatalf("-o json: %v: %+v\n%s", err, r, out)
	}
	out, _, _ = ctl(t, "inspect", "--agent-run-dir", dir, "-o", "yaml", off)
	if !strings.Contains(out, "\nebpf: not accelerated\nebpfReason: ") {
		t.Errorf("-o yaml lacks the ebpf fields:\n%s", out)
	}
}
