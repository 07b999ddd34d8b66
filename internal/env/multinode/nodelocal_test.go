package multinode_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/internal/env/demo"
	"github.com/meshcni/meshcni/internal/env/multinode"
	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/pkg/audit"
	"github.com/meshcni/meshcni/pkg/redirectprobe"
	"github.com/meshcni/meshcni/pkg/repair"
)

// agentComponent is the Event source (and reportingController) of the agent's Events.
const agentComponent = "meshcni-agent"

// The agents' counters the node-local proof compares: every action of the repair
// controller and of the audit.
var actionCounters = []string{"meshcni_repairs_total", "meshcni_drift_detected_total", "meshcni_drift_repaired_total"}

// TestNodeLocalScope: each node's agent caches and repairs only its own node's
// pods. The race is reproduced on node B only: B's agent is paused (SIGSTOP) and
// meshcni's entry taken out of B's conflist behind its back, so a meshed pod
// scheduled to B gets no redirect and its istio-validation (meshcnictl validate)
// exits 126. B's agent is resumed: it puts its entry back and its repair controller
// repairs the pod in place (istio-validation then exits 0, the redirect its
// annotations give is in its netns). The other nodes' agents do nothing about it:
// their repair and audit counters do not move while B's repair counter moves by
// one (each agent the same process throughout), their logs never name the pod while
// B's names it, and every Event the agents wrote about the pod is reported by
// meshcni-agent on node B (source.host and reportingInstance). The other nodes are
// judged only after one whole audit period (its longest, jitter included) since the
// pod was created, each of their agents having finished an audit round meanwhile: an
// agent auditing pods beyond its node would have met the pod by then.
func TestNodeLocalScope(t *testing.T) {
	c := cluster(t)
	tb := c.TB
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	nodes := tb.Nodes()
	if len(nodes) < 2 {
		t.Fatalf("the package's cluster has %d nodes, want at least 2", len(nodes))
	}
	b, others := nodes[len(nodes)-1], nodes[:len(nodes)-1]
	ns := namespace(t, c, "mn-scope")

	agents := agentsByNode(ctx, t, c)
	before := map[string]counters{}
	for _, n := range nodes {
		before[n.Name] = scrapeCounters(ctx, t, c, n.Name, actionCounters...)
	}

	// The race on B only: B's agent held, meshcni out of B's chain.
	pid := agentProcess(t, agents[b.Name])
	if err := unix.Kill(pid, unix.SIGSTOP); err != nil {
		t.Fatalf("SIGSTOP the agent on %s (pid %d): %v", b.Name, pid, err)
	}
	held, heldAt := true, time.Now()
	resume := func() {
		if held {
			held = false
			if err := unix.Kill(pid, unix.SIGCONT); err != nil {
				t.Errorf("SIGCONT the agent on %s (pid %d): %v", b.Name, pid, err)
			}
		}
	}
	var file string
	var orig []byte
	// Restore B for the tests that follow: its agent running, meshcni in its chain
	// (put back by the agent, else by the test, which is then an error), B meshed.
	t.Cleanup(func() {
		resume()
		if file != "" {
			restoreChain(t, b, file, orig)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		if err := c.WaitNodeMeshed(ctx, b); err != nil {
			t.Errorf("node %s after the test: %v", b.Name, err)
		}
	})
	file, orig = takeMeshcniOut(t, b)

	raced := c.MeshedPod(ns, "raced", b.Name)
	// The not-ready taint the taint controller may set while B's agent is held must
	// not keep the pod from B: it is scheduled during the race, as pods tolerating
	// every taint are.
	raced.Spec.Tolerations = []corev1.Toleration{{Key: demo.NotReadyTaint, Operator: corev1.TolerationOpExists}}
	// Its validation gives up after 2 s (the demo's 10 s would keep B's agent held
	// long enough for its liveness probe to restart it).
	for i, arg := range raced.Spec.InitContainers[0].Command {
		if strings.HasPrefix(arg, "--probe-timeout=") {
			raced.Spec.InitContainers[0].Command[i] = "--probe-timeout=2s"
		}
	}
	if _, err := tb.CreatePod(ctx, raced); err != nil {
		t.Fatal(err)
	}
	racedAt, rounds := time.Now(), map[string]counters{}
	for _, n := range others {
		rounds[n.Name] = scrapeCounters(ctx, t, c, n.Name, auditRounds)
	}
	pollUntil(ctx, t, time.Minute, "istio-validation of raced to exit 126 on "+b.Name, func() error {
		p := getPod(ctx, t, tb, ns, raced.Name)
		if _, exit := validationRuns(p); exit != redirectprobe.ExitCode {
			return fmt.Errorf("on %q, istio-validation last exit %d", p.Spec.NodeName, exit)
		}
		raced = p
		return nil
	})
	if live := liveRules(ctx, t, tb, raced); live != "" {
		t.Fatalf("raced started with meshcni out of %s's chain, yet its netns holds meshcni rules:\n%s", b.Name, live)
	}
	t.Logf("race reproduced on %s: raced (uid %s) started without meshcni, istio-validation exited %d", b.Name, raced.UID, redirectprobe.ExitCode)

	resume()
	resumed := time.Now()
	t.Logf("the agent on %s held (SIGSTOP) for %v", b.Name, resumed.Sub(heldAt).Round(time.Millisecond))
	pollUntil(ctx, t, 30*time.Second, "B's agent puts meshcni back into "+file, func() error {
		if !hasMeshcni(file) {
			return errors.New("no meshcni entry")
		}
		return nil
	})
	var repairedEv corev1.Event
	evSeen := pollUntil(ctx, t, time.Minute, "Event "+repair.ReasonRepaired+" on raced", func() error {
		ev, err := podEvent(ctx, tb, raced, repair.ReasonRepaired)
		repairedEv = ev
		return err
	})
	// Not tb.WaitPodReady: it gives up on the init container's CrashLoopBackOff,
	// which is what the pod shows until the kubelet's next try.
	var p *corev1.Pod
	pollUntil(ctx, t, time.Minute, "raced Ready", func() error {
		p = getPod(ctx, t, tb, ns, raced.Name)
		if !multinode.PodReady(p) {
			_, exit := validationRuns(p)
			return fmt.Errorf("phase %s, istio-validation last exit %d", p.Status.Phase, exit)
		}
		return nil
	})
	if p.UID != raced.UID {
		t.Fatalf("raced was replaced (uid %s → %s), want it repaired in place", raced.UID, p.UID)
	}
	if _, exit := validationRuns(p); exit != 0 {
		t.Errorf("raced Ready, yet istio-validation's last exit is %d, want 0", exit)
	}
	rep, err := c.Inspect(ctx, p)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Meshed == nil || !*rep.Meshed || rep.Status != "in-sync" || len(rep.Backends()) != 1 {
		t.Errorf("raced after the repair: inspect from %s says meshed %v, status %s, rules in %v (%v); want meshed, in-sync in one backend",
			b.Name, rep.Meshed, rep.Status, rep.Backends(), rep.Problems)
	}
	t.Logf("raced repaired on %s: Event %s seen %v after SIGCONT (%q), Ready %v after SIGCONT",
		b.Name, repair.ReasonRepaired, evSeen.Sub(resumed).Round(time.Millisecond), repairedEv.Message, time.Since(resumed).Round(time.Millisecond))

	checkAgentEvents(ctx, t, tb, p, b.Name)

	waitAuditRound(ctx, t, c, agents, others, racedAt, rounds)
	now := agentsByNode(ctx, t, c)
	for _, n := range nodes {
		if now[n.Name].UID != agents[n.Name].UID || restartsOf(now[n.Name]) != restartsOf(agents[n.Name]) {
			t.Fatalf("the agent on %s restarted during the test (pod %s → %s, restarts %d → %d): its counters cannot be compared",
				n.Name, agents[n.Name].UID, now[n.Name].UID, restartsOf(agents[n.Name]), restartsOf(now[n.Name]))
		}
	}
	repaired := `meshcni_repairs_total{action="repair",result="success"}`
	after := scrapeCounters(ctx, t, c, b.Name, actionCounters...)
	if got, was := after[repaired], before[b.Name][repaired]; got != was+1 {
		t.Errorf("on %s (the raced pod's node): %s %v → %v, want one repair", b.Name, repaired, was, got)
	}
	for _, n := range others {
		after := scrapeCounters(ctx, t, c, n.Name, actionCounters...)
		for k, v := range after {
			if was := before[n.Name][k]; v != was {
				t.Errorf("on %s (not the raced pod's node): %s %v → %v, want unchanged", n.Name, k, was, v)
			}
		}
		logs, err := tb.PodLogs(ctx, demo.ReleaseNamespace, now[n.Name].Name, "agent")
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(logs, string(p.UID)) {
			t.Errorf("the agent on %s logged about raced (uid %s), a pod of %s", n.Name, p.UID, b.Name)
		}
	}
	logs, err := tb.PodLogs(ctx, demo.ReleaseNamespace, now[b.Name].Name, "agent")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(logs, repair.LogSucceeded) || !strings.Contains(logs, string(p.UID)) {
		t.Errorf("the agent on %s did not log the repair of raced (uid %s)", b.Name, p.UID)
	}
	t.Logf("%s on %s: %v → %v; on %d other node(s) every repair and audit counter unchanged, no log line naming the pod",
		repaired, b.Name, before[b.Name][repaired], after[repaired], len(others))
}

// auditRounds is the agents' counter of finished audit rounds.
const auditRounds = "meshcni_audit_rounds_total"

// waitAuditRound waits until one audit period of the nodes' agents (its longest:
// +audit.Jitter) has passed since since, so that each has started a round after it,
// and then until each has finished a round since rounds were read.
func waitAuditRound(ctx context.Context, t *testing.T, c *multinode.Cluster, agents map[string]*corev1.Pod, nodes []*testbed.Node, since time.Time, rounds map[string]counters) {
	t.Helper()
	var longest time.Duration
	for _, n := range nodes {
		longest = max(longest, auditPeriod(t, agents[n.Name]))
	}
	longest = time.Duration(float64(longest) * (1 + audit.Jitter))
	if d := time.Until(since.Add(longest)); d > 0 {
		t.Logf("waiting %v: one audit period (%v at its longest) since raced was created", d.Round(time.Millisecond), longest)
		select {
		case <-ctx.Done():
			t.Fatalf("waiting for an audit period: %v", ctx.Err())
		case <-time.After(d):
		}
	}
	key := auditRounds + "{}"
	for _, n := range nodes {
		pollUntil(ctx, t, longest, "an audit round finished on "+n.Name+" since raced was created", func() error {
			if got, was := scrapeCounters(ctx, t, c, n.Name, auditRounds)[key], rounds[n.Name][key]; got <= was {
				return fmt.Errorf("%s %v, %v when raced was created", auditRounds, got, was)
			}
			return nil
		})
	}
}

// auditPeriod is the audit period the agent pod runs with (MESHCNI_AUDIT_PERIOD, else
// the agent's default); an agent with the audit off fails the test.
func auditPeriod(t *testing.T, agent *corev1.Pod) time.Duration {
	t.Helper()
	period := audit.DefaultPeriod
	for _, ctr := range agent.Spec.Containers {
		for _, e := range ctr.Env {
			if e.Name != "MESHCNI_AUDIT_PERIOD" {
				continue
			}
			d, err := time.ParseDuration(e.Value)
			if err != nil {
				t.Fatalf("agent pod %s: MESHCNI_AUDIT_PERIOD %q: %v", agent.Name, e.Value, err)
			}
			period = d
		}
	}
	if period <= 0 {
		t.Fatalf("agent pod %s on %s runs with the audit off: the proof needs it on", agent.Name, agent.Spec.NodeName)
	}
	return period
}

// restoreChain waits for the agent to have put meshcni back into file; if it has
// not, the test failed early: the file is restored and that is an error.
func restoreChain(t *testing.T, n *testbed.Node, file string, orig []byte) {
	deadline := time.Now().Add(10 * time.Second)
	for !hasMeshcni(file) {
		if time.Now().After(deadline) {
			t.Errorf("%s: meshcni still out of %s's chain at the end; restoring it", file, n.Name)
			if err := replaceFile(file, orig); err != nil {
				t.Error(err)
			}
			return
		}
		time.Sleep(pollEvery)
	}
}

// podEvent returns the pod's (by UID) Event with reason.
func podEvent(ctx context.Context, tb *testbed.Testbed, p *corev1.Pod, reason string) (corev1.Event, error) {
	evs, err := tb.Client.CoreV1().Events(p.Namespace).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.uid=" + string(p.UID)})
	if err != nil {
		return corev1.Event{}, err
	}
	var seen []string
	for _, e := range evs.Items {
		if e.Reason == reason {
			return e, nil
		}
		seen = append(seen, e.Reason)
	}
	return corev1.Event{}, fmt.Errorf("%d events, none %s: %v", len(evs.Items), reason, seen)
}

// checkAgentEvents: every Event of the pod's namespace written by an agent is
// reported by the agent of node (source.host and reportingInstance), and the pod has one.
func checkAgentEvents(ctx context.Context, t *testing.T, tb *testbed.Testbed, p *corev1.Pod, node string) {
	t.Helper()
	evs, err := tb.Client.CoreV1().Events(p.Namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var onPod int
	for _, e := range evs.Items {
		if e.Source.Component != agentComponent && e.ReportingController != agentComponent {
			continue
		}
		if e.Source.Host != node || e.ReportingInstance != node || e.Source.Component != agentComponent || e.ReportingController != agentComponent {
			t.Errorf("Event %s %s on %s/%s reported by %s/%s (source host %q), want %s on node %s",
				e.Type, e.Reason, e.InvolvedObject.Kind, e.InvolvedObject.Name, e.ReportingController, e.ReportingInstance, e.Source.Host, agentComponent, node)
		}
		if e.InvolvedObject.UID == p.UID {
			onPod++
		}
	}
	if onPod == 0 {
		t.Errorf("no Event from %s about %s", agentComponent, p.Name)
	}
	t.Logf("%d agent Event(s) about %s, all reported by %s on %s", onPod, p.Name, agentComponent, node)
}
