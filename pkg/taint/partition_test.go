package taint

// A leader that lost its Lease but still runs — cut off from the API server, or paused
// and resumed — must stop writing before another replica leads. Two real
// meshcni-taint-controller processes against the real API server, each through its own
// fault-injecting proxy (internal/standin/apiproxy), which logs every request the process
// sent: a node write is attributed to a replica by the proxy it came through.

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/internal/standin/apiproxy"
	itestutil "github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/internal/tools/build/ociimage"
)

// The timings of the partition tests: a lease of 4 s renewed every 1 s, a renew
// deadline of 2 s (the fence: no node write later than 2 s after the last renewal
// sent, at least 2 s before another replica can lead). A retry period of 1 s makes
// every renewal a new record to the other replica (whole-second times).
const (
	ptLease  = 4 * time.Second
	ptRenew  = 2 * time.Second
	ptRetry  = time.Second
	ptGrace  = 2 * time.Second
	leaseAPI = "/apis/coordination.k8s.io/v1/namespaces/"
	nodesAPI = "/api/v1/nodes"
)

// builtController builds cmd/meshcni-taint-controller for the test.
func builtController(t *testing.T) string {
	t.Helper()
	itestutil.RequireBinary(t, "go")
	root, err := itestutil.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(t.TempDir(), Component)
	if err := ociimage.GoBinary(context.Background(), root, "./cmd/meshcni-taint-controller", bin); err != nil {
		t.Fatal(err)
	}
	return bin
}

// proc is one controller process behind its own proxy.
type proc struct {
	id       string
	proxy    *apiproxy.Proxy
	cmd      *exec.Cmd
	exited   chan struct{}
	exitCode int
	exitedAt time.Time
	mu       sync.Mutex
	lines    []map[string]any
}

func (e *env) startProc(t *testing.T, bin, id string) *proc {
	t.Helper()
	px, err := apiproxy.Start(e.tb.RESTConfig)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(px.Close)
	kc := filepath.Join(t.TempDir(), id+".kubeconfig")
	if err := px.WriteKubeconfig(kc); err != nil {
		t.Fatal(err)
	}
	p := &proc{id: id, proxy: px, exited: make(chan struct{})}
	p.cmd = exec.Command(bin)
	p.cmd.Env = []string{
		"POD_NAMESPACE=" + e.ns,
		"MESHCNI_KUBECONFIG=" + kc,
		"MESHCNI_NODE_SELECTOR=" + testNodeLabel + "=" + e.label,
		"MESHCNI_GRACE_PERIOD=" + ptGrace.String(),
		"MESHCNI_TAINT_MODE=always", "MESHCNI_MAX_TAINTED_FRACTION=1",
		"MESHCNI_LEASE_DURATION=" + ptLease.String(), "MESHCNI_RENEW_DEADLINE=" + ptRenew.String(), "MESHCNI_RETRY_PERIOD=" + ptRetry.String(),
		"MESHCNI_HEALTH_ADDR=127.0.0.1:0", "MESHCNI_LOG_LEVEL=debug",
		"MESHCNI_IDENTITY=" + id,
	}
	stderr, err := p.cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			var rec map[string]any
			if json.Unmarshal(sc.Bytes(), &rec) != nil {
				rec = map[string]any{"msg": sc.Text()}
			}
			if lvl, _ := rec["level"].(string); !strings.HasPrefix(lvl, "DEBUG") {
				t.Logf("%s: %s", id, sc.Text())
			}
			p.mu.Lock()
			p.lines = append(p.lines, rec)
			p.mu.Unlock()
		}
		err := p.cmd.Wait()
		p.exitedAt = time.Now()
		p.exitCode = p.cmd.ProcessState.ExitCode()
		if err != nil && p.exitCode == 0 {
			p.exitCode = -1
		}
		close(p.exited)
	}()
	t.Cleanup(func() {
		select {
		case <-p.exited:
		default:
			_ = p.cmd.Process.Signal(syscall.SIGCONT)
			_ = p.cmd.Process.Kill()
			<-p.exited
		}
	})
	return p
}

// logged returns the times of the process's log records with msg whose attributes
// include want.
func (p *proc) logged(msg string, want map[string]string) []time.Time {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []time.Time
next:
	for _, l := range p.lines {
		if l["msg"] != msg {
			continue
		}
		for k, v := range want {
			if fmt.Sprint(l[k]) != v {
				continue next
			}
		}
		at, _ := time.Parse(time.RFC3339Nano, fmt.Sprint(l["time"]))
		out = append(out, at)
	}
	return out
}

// leaseWrites are the process's successful writes of the Lease (acquisitions and
// renewals; a release too), as its proxy forwarded them.
func (p *proc) leaseWrites() []apiproxy.Request {
	var out []apiproxy.Request
	for _, r := range apiproxy.Writes(p.proxy.Requests(), leaseAPI) {
		if r.Status/100 == 2 {
			out = append(out, r)
		}
	}
	return out
}

// renewalAfter waits for a successful Lease write of p forwarded after since.
func (e *env) renewalAfter(p *proc, since time.Time) apiproxy.Request {
	e.t.Helper()
	var got apiproxy.Request
	e.eventually(3*ptLease, p.id+" renews the Lease", func() bool {
		for _, r := range p.leaseWrites() {
			if r.Forwarded.After(since) {
				got = r
				return true
			}
		}
		return false
	})
	return got
}

func (e *env) holder() string {
	e.t.Helper()
	l, err := e.cs.CoordinationV1().Leases(e.ns).Get(e.ctx, Component, metav1.GetOptions{})
	if err != nil || l.Spec.HolderIdentity == nil {
		return ""
	}
	return *l.Spec.HolderIdentity
}

// twoProcs starts replica-a, lets it lead, starts replica-b and lets it see replica-a
// lead; then brings three nodes to a known state: pt-1 with a Ready agent (no taint),
// pt-2 without an agent (tainted), pt-3 with a Ready agent (no taint).
func (e *env) twoProcs(t *testing.T, prefix string) (a, b *proc) {
	t.Helper()
	bin := builtController(t)
	a = e.startProc(t, bin, "replica-a")
	e.eventually(15*time.Second, "replica-a holds the Lease", func() bool { return e.holder() == "replica-a" })
	b = e.startProc(t, bin, "replica-b")
	e.eventually(15*time.Second, "replica-b observes replica-a leading", func() bool {
		return len(b.logged("leader observed", map[string]string{"leader": "replica-a"})) > 0
	})
	for i := 1; i <= 3; i++ {
		e.createNode(fmt.Sprintf("%s-%d", prefix, i))
	}
	e.createAgent("agent-"+prefix+"-1", prefix+"-1", true)
	e.createAgent("agent-"+prefix+"-3", prefix+"-3", true)
	e.waitTaint(prefix+"-1", false, 10*time.Second)
	e.waitTaint(prefix+"-2", true, 10*time.Second)
	e.waitTaint(prefix+"-3", false, 10*time.Second)
	if w := apiproxy.Writes(b.proxy.Requests(), nodesAPI); len(w) > 0 {
		t.Fatalf("the follower wrote nodes: %+v", w)
	}
	return a, b
}

// takeover waits until replica-b holds the Lease and checks that it acquired it no
// sooner than a lease duration after replica-a's last renewal: the forwarding times of
// the two Lease writes, as the proxies saw them, bound the API server's. It returns
// when replica-b's acquisition was forwarded.
func (e *env) takeover(t *testing.T, a, b *proc, cut time.Time) time.Time {
	t.Helper()
	e.eventually(6*ptLease, "replica-b takes over the Lease", func() bool { return e.holder() == "replica-b" })
	var lastA, acqB apiproxy.Request
	for _, r := range a.leaseWrites() {
		if r.Forwarded.Before(cut) && r.Forwarded.After(lastA.Forwarded) {
			lastA = r
		}
	}
	for _, r := range b.leaseWrites() {
		if acqB.Forwarded.IsZero() {
			acqB = r
		}
	}
	if lastA.Forwarded.IsZero() || acqB.Forwarded.IsZero() {
		t.Fatalf("Lease writes: replica-a's last %+v, replica-b's first %+v", lastA, acqB)
	}
	gap := acqB.Forwarded.Sub(lastA.Forwarded)
	t.Logf("replica-b acquired the Lease %s after replica-a's last renewal (lease duration %s)", gap.Round(time.Millisecond), ptLease)
	if gap < ptLease {
		t.Errorf("replica-b acquired %s after replica-a's last renewal, want no sooner than the lease duration %s", gap, ptLease)
	}
	return acqB.Forwarded
}

// nodeWritesSent returns replica p's node writes that reached its proxy at or after
// since: sent by the process, whether or not the proxy let them through.
func nodeWritesSent(p *proc, since time.Time) []apiproxy.Request {
	var out []apiproxy.Request
	for _, r := range apiproxy.Writes(p.proxy.Requests(), nodesAPI) {
		if !r.Received.Before(since) {
			out = append(out, r)
		}
	}
	return out
}

func (p *proc) waitExit(t *testing.T, within time.Duration) {
	t.Helper()
	select {
	case <-p.exited:
	case <-time.After(within):
		t.Fatalf("%s still runs %s later", p.id, within)
	}
}

// TestPartitionedLeader: the leader is cut off from the API server (its proxy holds
// every request and every watch event) right after a renewal, with a node write due
// 2.2 s later (an agent pod lost, grace 2 s). The leader sends no node write once its
// fence lapsed, stops leading before the other replica leads, and exits 1; the other
// replica takes over no sooner than a lease duration after the last renewal and
// brings the node to the right state.
func TestPartitionedLeader(t *testing.T) {
	e := newEnv(t, "meshcni-taint-part", "part")
	log := e.watchTaints()
	a, b := e.twoProcs(t, "part")

	// Just after a renewal, the agent of part-1 goes; once the leader has decided
	// (grace running: its write is due 2 s after the decision, after its fence lapses),
	// it is cut off.
	renewed := e.renewalAfter(a, time.Now())
	e.deleteAgent("agent-part-1", true)
	e.eventually(5*time.Second, "replica-a decides about part-1 without an agent", func() bool {
		return len(a.logged(LogDecided, map[string]string{"node": "part-1", "agent_pods": ""})) > 0
	})
	cut := time.Now()
	a.proxy.Partition()
	flipsBefore := len(log.of("part-1"))
	t.Logf("replica-a cut off %s after its last renewal was forwarded", cut.Sub(renewed.Forwarded).Round(time.Millisecond))

	acquired := e.takeover(t, a, b, cut)
	// client-go's elector gives up a retry period + renew deadline after the last
	// renewal, then tries to release the Lease (up to another renew deadline) before
	// it ends the leading context: the workers may outlive the Lease. The fence, not
	// the elector, stops the writes.
	if stopped := a.logged("stopped leading", map[string]string{"identity": "replica-a"}); len(stopped) > 0 {
		t.Logf("replica-a's workers stopped %s after its last renewal, %s before replica-b acquired",
			stopped[0].Sub(renewed.Forwarded).Round(time.Millisecond), acquired.Sub(stopped[0]).Round(time.Millisecond))
	}
	held := a.logged(LogWriteHeld, map[string]string{"node": "part-1"})
	if len(held) == 0 {
		t.Error("replica-a never tried to write part-1 after the grace: the test proves nothing")
	} else {
		t.Logf("replica-a held its write to part-1 %s after its last renewal", held[0].Sub(renewed.Forwarded).Round(time.Millisecond))
	}
	if w := nodeWritesSent(a, cut); len(w) > 0 {
		t.Errorf("replica-a sent %d node write(s) after it was cut off: %+v", len(w), w)
	}
	a.waitExit(t, 3*ptLease)
	if a.exitCode != 1 {
		t.Errorf("replica-a exited %d, want 1 (lost Lease)", a.exitCode)
	}
	a.proxy.Heal()

	// The new leader taints part-1 a grace period after its takeover; every node is
	// right, and every node write after the cut is replica-b's.
	e.waitTaint("part-1", true, ptGrace+10*time.Second)
	for n, want := range map[string]bool{"part-1": true, "part-2": true, "part-3": false} {
		if HasTaint(e.node(n)) != want {
			t.Errorf("node %s tainted=%v, want %v", n, !want, want)
		}
	}
	if fs := log.of("part-1")[flipsBefore:]; len(fs) != 1 || !fs[0].tainted {
		t.Errorf("part-1's taint changed %+v after the cut, want one add", fs)
	}
	for _, r := range apiproxy.Writes(a.proxy.Requests(), nodesAPI) {
		if !r.Forwarded.IsZero() && !r.Forwarded.Before(cut) {
			t.Errorf("replica-a's node write forwarded after the cut: %+v", r)
		}
	}
}

// TestPausedLeader: the leader is paused (SIGSTOP) right after a renewal until the
// other replica leads, then resumed (SIGCONT) while the new leader's watches are
// stalled, and a new node is created: only the old leader sees it. It must not write
// (its fence lapsed while it was paused, whatever its elector believes until its next
// renewal fails); it exits 1, and the new leader taints the node once its watches run.
func TestPausedLeader(t *testing.T) {
	e := newEnv(t, "meshcni-taint-pause", "pause")
	log := e.watchTaints()
	a, b := e.twoProcs(t, "pause")

	renewed := e.renewalAfter(a, time.Now())
	time.Sleep(100 * time.Millisecond)
	paused := time.Now()
	if err := a.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	t.Logf("replica-a paused %s after its last renewal was forwarded", paused.Sub(renewed.Forwarded).Round(time.Millisecond))
	acquired := e.takeover(t, a, b, paused)
	// The new leader reconciled every node (nothing to change) and renewed once.
	for _, n := range []string{"pause-1", "pause-2", "pause-3"} {
		e.eventually(10*time.Second, "replica-b decides about "+n, func() bool { return len(b.logged(LogDecided, map[string]string{"node": n})) > 0 })
	}
	e.renewalAfter(b, acquired)

	b.proxy.StallWatches()
	resumed := time.Now()
	if err := a.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	e.createNode("pause-4")
	e.eventually(5*time.Second, "replica-a decides about pause-4", func() bool {
		return len(a.logged(LogDecided, map[string]string{"node": "pause-4"})) > 0
	})
	a.waitExit(t, 3*ptLease)
	if len(a.logged(LogWriteHeld, map[string]string{"node": "pause-4"})) == 0 {
		t.Error("replica-a never tried to write pause-4: the test proves nothing")
	}
	t.Logf("replica-a exited %d, %s after it was resumed (paused %s)", a.exitCode, a.exitedAt.Sub(resumed).Round(time.Millisecond), resumed.Sub(paused).Round(time.Millisecond))
	if w := nodeWritesSent(a, paused); len(w) > 0 {
		t.Errorf("replica-a sent %d node write(s) after it was paused (replica-b leads since %s): %+v", len(w), acquired.Format(time.StampMilli), w)
	}
	if a.exitCode != 1 {
		t.Errorf("replica-a exited %d, want 1 (lost Lease)", a.exitCode)
	}
	if HasTaint(e.node("pause-4")) {
		t.Error("pause-4 tainted while the leader's watches were stalled: by the old leader")
	}
	if h := e.holder(); h != "replica-b" {
		t.Fatalf("Lease holder %q after the old leader resumed, want replica-b", h)
	}

	b.proxy.Heal()
	took := e.waitTaint("pause-4", true, 10*time.Second)
	t.Logf("pause-4 tainted %s after replica-b's watches resumed", took.Round(time.Millisecond))
	for n, want := range map[string]bool{"pause-1": false, "pause-2": true, "pause-3": false, "pause-4": true} {
		if HasTaint(e.node(n)) != want {
			t.Errorf("node %s tainted=%v, want %v", n, !want, want)
		}
	}
	if fs := log.of("pause-4"); len(fs) != 1 || !fs[0].tainted {
		t.Errorf("pause-4's taint changed %+v, want one add", fs)
	}
	var bw []string
	for _, r := range nodeWritesSent(b, resumed) {
		bw = append(bw, r.Method+" "+r.Path+" "+fmt.Sprint(r.Status))
	}
	if len(bw) != 1 || !strings.HasSuffix(bw[0], "/pause-4 200") {
		t.Errorf("replica-b's node writes after the resume: %q, want one PATCH of pause-4", bw)
	}
}
