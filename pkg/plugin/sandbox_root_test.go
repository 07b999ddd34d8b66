package plugin

import (
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/agentsock"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/ebpf/sockmap"
)

// TestAddReportsSandbox: every successful ADD of a Kubernetes pod tells the agent
// what it decided (meshed, or skipped and why) and the identity of CNI_NETNS (its
// file's device and inode as stat reads them, its cookie as pkg/ebpf/sockmap reads
// it), whether the pod is meshed or not; the agent records skipped pods as well.
// Root: the identity is of a scratch netns.
func TestAddReportsSandbox(t *testing.T) {
	testutil.RequireRoot(t)
	netns := testutil.NewNetns(t)
	cookie, err := sockmap.NetnsCookie(netns)
	if err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	if err := unix.Stat(netns, &st); err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		name, namespace string
		ann             map[string]string
		decision        string
		reason          string // a part of the reason
	}{
		{"meshed", "app", nil, agentsock.DecisionMeshed, ""},
		{"interception NONE", "app", map[string]string{capture.AnnotationInterceptionMode: "NONE"}, agentsock.DecisionSkipped, "captures no traffic"},
		{"excluded namespace", "kube-system", nil, agentsock.DecisionSkipped, "kube-system is excluded"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t)
			h.api.AddPod(meshed(tt.namespace, "web", tt.ann))
			got := serveCommands(t, h.runDir)
			args := cmdArgs(tt.namespace, "web", "uid-web", conf(t, "1.0.0", h.runDir, prevResult100, nil))
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
			want := agentsock.Sandbox{PodUID: "uid-web", Decision: tt.decision, Netns: netns, NetnsDev: uint64(st.Dev), NetnsInode: st.Ino, NetnsCookie: cookie}
			if r.Sandbox == nil {
				t.Fatal("no sandbox report")
			}
			sb := *r.Sandbox
			if !strings.Contains(sb.Reason, tt.reason) || sb.Reason == "" {
				t.Errorf("reason %q, want one containing %q", sb.Reason, tt.reason)
			}
			sb.Reason = ""
			if sb != want {
				t.Errorf("sandbox %+v, want %+v", sb, want)
			}
		})
	}
}
