package plugin

import (
	"context"
	"testing"
	"time"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/agentsock"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/ebpf/sockmap"
)

// TestAddReportsNetnsCookie: a successful ADD of a meshed pod tells the agent the
// pod netns's cookie (as pkg/ebpf/sockmap reads it, not the host's), the pod's
// annotation and its proxy UID, with the sandbox's ID; a pod whose annotation says
// off sends no eBPF details. Root: the cookie is read inside a scratch netns.
func TestAddReportsNetnsCookie(t *testing.T) {
	testutil.RequireRoot(t)
	// The host's first: testutil.NewNetns may leave the process's main thread,
	// which /proc/self names, in the new namespace.
	host, err := sockmap.NetnsCookie("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	netns := testutil.NewNetns(t)
	want, err := sockmap.NetnsCookie(netns)
	if err != nil {
		t.Fatal(err)
	}
	if want == host {
		t.Fatalf("scratch netns and host share cookie %d", want)
	}
	for _, tt := range []struct {
		annotation string // "": none
		want       *agentsock.PodEBPF
	}{
		{"", &agentsock.PodEBPF{NetnsCookie: want, ProxyUID: 1337, PodUID: "uid-web"}},
		{"both", &agentsock.PodEBPF{NetnsCookie: want, Mode: "both", ProxyUID: 1337, PodUID: "uid-web"}},
		{"off", nil},
	} {
		t.Run("annotation="+tt.annotation, func(t *testing.T) {
			h := newHarness(t)
			ann := map[string]string{}
			if tt.annotation != "" {
				ann[capture.AnnotationEBPFAcceleration] = tt.annotation
			}
			h.api.AddPod(meshed("app", "web", ann))
			got := serveCommands(t, h.runDir)
			args := cmdArgs("app", "web", "uid-web", conf(t, "1.0.0", h.runDir, prevResult100, nil))
			args.Netns = netns
			if err := h.p.Add(args); err != nil {
				t.Fatal(err)
			}
			var r *agentsock.CommandResult
			select {
			case r = <-got:
			case <-time.After(10 * time.Second):
				t.Fatal("the agent socket got no command result")
			}
			if r.Command != agentsock.CommandAdd || r.ContainerID != args.ContainerID {
				t.Errorf("command %s container %q, want ADD %q", r.Command, r.ContainerID, args.ContainerID)
			}
			if (r.EBPF == nil) != (tt.want == nil) || r.EBPF != nil && *r.EBPF != *tt.want {
				t.Errorf("eBPF details %+v, want %+v", r.EBPF, tt.want)
			}
		})
	}
}

// serveCommands serves an agent socket in runDir and passes on its command results.
func serveCommands(t *testing.T, runDir string) <-chan *agentsock.CommandResult {
	ch := make(chan *agentsock.CommandResult, 4)
	srv := &agentsock.Server{Path: agentsock.Path(runDir), OnCommand: func(r *agentsock.CommandResult) { ch <- r }}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	deadline := time.Now().Add(5 * time.Second)
	for !socketUp(runDir) {
		if time.Now().After(deadline) {
			t.Fatal("agent socket not listening")
		}
		time.Sleep(5 * time.Millisecond)
	}
	return ch
}

func socketUp(runDir string) bool {
	c, err := agentsock.Dial(runDir)
	if err != nil {
		return false
	}
	_ = c.Close()
	return true
}
