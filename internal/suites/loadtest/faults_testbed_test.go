package loadtest_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/suites/loadtest"
	"github.com/meshcni/meshcni/internal/testkit/agenttest"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/fileutil"
	"github.com/meshcni/meshcni/pkg/plugin"
	"github.com/meshcni/meshcni/pkg/podget/helper"
)

const (
	envKillEvery    = "MESHCNI_LOAD_KILL_EVERY"    // agent SIGKILL period
	envRewriteEvery = "MESHCNI_LOAD_REWRITE_EVERY" // primary CNI rewrite period
	envAPIEvery     = "MESHCNI_LOAD_API_EVERY"     // API server restart period
)

// daemonSet runs meshcni-agent the way a DaemonSet does: one run directory and
// command line across restarts; kill SIGKILLs the running agent and the loop starts
// the next one after delay.
type daemonSet struct {
	t      *testing.T
	bin    string
	args   []string
	logDir string
	delay  time.Duration

	mu       sync.Mutex
	cmd      *exec.Cmd
	done     chan struct{}
	waitErr  error
	starts   int
	kills    int
	crashes  []string // agents that exited before their SIGKILL
	stopping bool
}

func newDaemonSet(t *testing.T, r *rig) *daemonSet {
	t.Helper()
	bins := agenttest.Binaries(t)
	runDir, err := os.MkdirTemp("", "mcni-load-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(runDir) })
	d := &daemonSet{
		t: t, bin: filepath.Join(bins, agenttest.AgentBinary), logDir: t.TempDir(), delay: 200 * time.Millisecond,
		args: []string{
			"--cni-conf-dir", r.confDir, "--cni-bin-dir", r.binDir,
			"--plugin-binary", filepath.Join(bins, agenttest.PluginBinary),
			"--run-dir", runDir,
			"--kubeconfig-source", testbed.KubeconfigPath(), "--kubeconfig", testbed.KubeconfigPath(),
			"--node-name", r.node, "--health-addr", "127.0.0.1:0", "--log-level", "debug",
		},
	}
	d.start()
	t.Cleanup(func() {
		d.mu.Lock()
		d.stopping = true
		cmd, done := d.cmd, d.done
		d.mu.Unlock()
		if cmd != nil {
			_ = cmd.Process.Kill()
			<-done
		}
	})
	return d
}

func (d *daemonSet) start() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.stopping {
		return
	}
	d.starts++
	logf, err := os.Create(filepath.Join(d.logDir, fmt.Sprintf("agent-%d.log", d.starts)))
	if err != nil {
		d.t.Error(err)
		return
	}
	cmd := exec.Command(d.bin, d.args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		logf.Close()
		d.t.Errorf("start meshcni-agent: %v", err)
		return
	}
	done := make(chan struct{})
	d.cmd, d.done = cmd, done
	go func() {
		err := cmd.Wait()
		logf.Close()
		d.mu.Lock()
		d.waitErr = err
		d.mu.Unlock()
		close(done)
	}()
}

// kill SIGKILLs the running agent, waits for it and starts the next after the delay.
func (d *daemonSet) kill() {
	d.mu.Lock()
	cmd, done := d.cmd, d.done
	d.kills++
	d.mu.Unlock()
	select {
	case <-done:
		d.mu.Lock()
		d.crashes = append(d.crashes, fmt.Sprintf("agent %d exited by itself: %v", d.starts, d.waitErr))
		d.mu.Unlock()
	default:
	}
	_ = cmd.Process.Signal(syscall.SIGKILL)
	<-done
	time.Sleep(d.delay)
	d.start()
}

// stop sends SIGTERM to the running agent (it uninstalls) and returns its exit error.
func (d *daemonSet) stop() error {
	d.mu.Lock()
	d.stopping = true
	cmd, done := d.cmd, d.done
	d.mu.Unlock()
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		_ = cmd.Process.Kill()
		<-done
		return errors.New("meshcni-agent did not exit within 20 s of SIGTERM")
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.cmd = nil
	return d.waitErr
}

func (d *daemonSet) lastLog() string {
	b, _ := os.ReadFile(filepath.Join(d.logDir, fmt.Sprintf("agent-%d.log", d.starts)))
	return string(b)
}

// confReads is the reader's verdict on the CNI configuration it read in a loop.
type confReads struct {
	reads, withEntry, withoutEntry atomic.Int64
	mu                             sync.Mutex
	bad                            []string // invalid, or more than one entry
	// windows are the spans from the first read without the entry to the next read
	// with it.
	windows []time.Duration
}

func (c *confReads) badf(format string, args ...any) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.bad) < 20 {
		c.bad = append(c.bad, fmt.Sprintf(format, args...))
	}
}

// readLoop reads the configuration the runtime would load, every millisecond, until
// ctx ends: it must always be valid JSON with at most one meshcni entry.
func (r *rig) readLoop(ctx context.Context, c *confReads) {
	var gone time.Time // when a read first found no entry
	for ctx.Err() == nil {
		files, err := libcni.ConfFiles(r.confDir, []string{".conf", ".conflist", ".json"})
		switch {
		case err != nil:
			c.badf("list: %v", err)
		case len(files) == 0:
			c.badf("no configuration file")
		default:
			slices.Sort(files)
			data, err := os.ReadFile(files[0])
			if err != nil {
				c.badf("read %s: %v", files[0], err)
				break
			}
			c.reads.Add(1)
			n, err := loadtest.MeshcniEntries(data)
			switch {
			case err != nil:
				c.badf("%s: %v:\n%s", files[0], err, data)
			case n > 1:
				c.badf("%s: %d meshcni entries:\n%s", files[0], n, data)
			case n == 1:
				c.withEntry.Add(1)
				if !gone.IsZero() {
					c.windows = append(c.windows, time.Since(gone))
					gone = time.Time{}
				}
			default:
				c.withoutEntry.Add(1)
				if gone.IsZero() {
					gone = time.Now()
				}
			}
		}
		time.Sleep(time.Millisecond)
	}
}

// every runs fn every period until ctx ends and returns how often it ran.
func every(ctx context.Context, wg *sync.WaitGroup, period time.Duration, fn func()) *atomic.Int64 {
	var n atomic.Int64
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(period)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				fn()
				n.Add(1)
			}
		}
	}()
	return &n
}

// errorKinds groups error messages by their start, most frequent first.
func errorKinds(errs []string) string {
	kinds := map[string]int{}
	for _, e := range errs {
		_, msg, _ := strings.Cut(e, ": ")
		if len(msg) > 140 {
			msg = msg[:140]
		}
		kinds[msg]++
	}
	var out []string
	for k, n := range kinds {
		out = append(out, fmt.Sprintf("%6d × %s", n, k))
	}
	sort.Sort(sort.Reverse(sort.StringSlice(out)))
	return strings.Join(out, "\n")
}

// TestChurnFaults: the churn of TestChurn while the agent is SIGKILLed every few
// seconds (and restarted as its DaemonSet would), the primary CNI rewrites its
// conflist without meshcni's entry in a loop, and the API server restarts (when this
// process owns the test bed). Every ADD that returned success on a configuration
// holding meshcni's entry must have redirected the pod; the configuration, read in a
// loop, is always valid JSON with at most one meshcni entry; DEL never fails and
// leaves no rule; nothing is left on the host; the last agent, stopped with SIGTERM,
// puts the primary's file back as it was. Every fault kind happened at least once
// (under CI=true the API server restarts too), and no more ADDs failed than the API
// server's outages can fail (loadtest.MaxFailedADDs: none while each outage is
// shorter than the plugin's api_timeout less the helper's pause between attempts).
func TestChurnFaults(t *testing.T) {
	testutil.RequireRoot(t)
	cycles, workers := counts(t, ciFaultCycles)
	killEvery, err := loadtest.Duration(envKillEvery, 3*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	rewriteEvery, err := loadtest.Duration(envRewriteEvery, 500*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	apiEvery, err := loadtest.Duration(envAPIEvery, 8*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	tb := testbed.API(t)
	r := newRig(t, tb)
	ds := newDaemonSet(t, r)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Hour)
	defer cancel()
	waitEntry(t, r, ds)
	apiTimeout := entryAPITimeout(t, r)

	// Warm-up without faults.
	if ta := r.churn(ctx, workers, workers, nil); len(ta.addErrs)+len(ta.delErrs)+len(ta.unredirected) > 0 {
		t.Fatalf("warm-up: %s\n%s\n%s\n%s", ta.summary(), first(ta.addErrs, 5), first(ta.unredirected, 5), ds.lastLog())
	}
	before := r.host(t)

	fctx, stopFaults := context.WithCancel(ctx)
	var wg sync.WaitGroup
	reads := &confReads{}
	wg.Add(1)
	go func() { defer wg.Done(); r.readLoop(fctx, reads) }()
	every(fctx, &wg, killEvery, ds.kill)
	rewrites := every(fctx, &wg, rewriteEvery, func() {
		if err := fileutil.WriteFileAtomic(filepath.Join(r.confDir, primaryName), r.primary, 0o644); err != nil {
			t.Errorf("primary rewrite: %v", err)
		}
	})
	var apiRestarts *atomic.Int64
	var outages []loadtest.Span // each API server restart, from its stop to its ready; read after wg.Wait
	if tb.Owned() {
		apiRestarts = every(fctx, &wg, apiEvery, func() {
			rctx, cancel := context.WithTimeout(fctx, 2*time.Minute)
			defer cancel()
			out := loadtest.Span{Start: time.Now()}
			err := tb.Restart(rctx, "kube-apiserver")
			out.End = time.Now()
			outages = append(outages, out)
			if err != nil && fctx.Err() == nil {
				t.Errorf("restart the API server: %v", err)
			}
		})
	} else {
		t.Log("the test bed is attached (hack/testbed up): no API server restarts")
	}
	began := time.Now()
	ta := r.churn(ctx, cycles, workers, nil)
	took := time.Since(began)
	stopFaults()
	wg.Wait()

	nAPI := int64(0)
	if apiRestarts != nil {
		nAPI = apiRestarts.Load()
	}
	t.Logf("%d cycles, %d workers, %v; faults: agent SIGKILLed %d times (every %v), primary conflist rewritten %d times (every %v), API server restarted %d times (every %v)",
		cycles, workers, took.Round(time.Second), ds.kills, killEvery, rewrites.Load(), rewriteEvery, nAPI, apiEvery)
	t.Logf("%s", ta.summary())
	w50, w99, wmax := loadtest.Percentiles(reads.windows)
	t.Logf("configuration read %d times: with meshcni's entry %d, without %d (between a primary rewrite and the re-injection: %d windows, p50 %v p99 %v max %v), invalid or doubled %d",
		reads.reads.Load(), reads.withEntry.Load(), reads.withoutEntry.Load(), len(reads.windows),
		w50.Round(time.Millisecond), w99.Round(time.Millisecond), wmax.Round(time.Millisecond), len(reads.bad))
	if len(ta.addErrs) > 0 {
		t.Logf("failed ADDs (fail closed: the pod is not started), by message:\n%s", errorKinds(ta.addErrs))
	}

	// Each kind of fault happened, and reached what it aims at.
	if ds.kills == 0 {
		t.Errorf("the agent was never SIGKILLed during the %v of churn (every %v): raise %s or lower %s", took.Round(time.Millisecond), killEvery, envCycles, envKillEvery)
	}
	if rewrites.Load() == 0 || reads.withoutEntry.Load() == 0 {
		t.Errorf("the primary rewrote its conflist %d times and the reader found meshcni's entry missing %d times during the %v of churn (every %v): want both above 0; raise %s or lower %s",
			rewrites.Load(), reads.withoutEntry.Load(), took.Round(time.Millisecond), rewriteEvery, envCycles, envRewriteEvery)
	}
	switch {
	case tb.Owned() && nAPI == 0:
		t.Errorf("the API server never restarted during the %v of churn (every %v): raise %s or lower %s", took.Round(time.Millisecond), apiEvery, envCycles, envAPIEvery)
	case !tb.Owned() && testutil.InCI():
		t.Error("no API server restarts: the test bed is attached (hack/testbed up), and CI=true needs every fault kind")
	}
	// Only the API server's absence can fail an ADD: while the agent is away the plugin
	// asks the API server through its helper, and an ADD that reads the primary's
	// rewrite runs without meshcni. MaxFailedADDs bounds what the outages can fail.
	maxFailed, err := loadtest.MaxFailedADDs(outages, apiTimeout, helperMaxPause, workers)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("failed ADDs %d; at most %d by the fault schedule (%s, api_timeout %v, %d workers)",
		len(ta.addErrs), maxFailed, spansText(outages), apiTimeout, workers)
	if len(ta.addErrs) > maxFailed {
		t.Errorf("%d ADDs failed, more than the %d the API server's outages can fail:\n%s", len(ta.addErrs), maxFailed, first(ta.addErrs, 10))
	}

	if len(ds.crashes) > 0 {
		t.Errorf("meshcni-agent exited without being killed:\n%s", strings.Join(ds.crashes, "\n"))
	}
	if len(ta.unredirected) > 0 {
		t.Errorf("ADD succeeded on a chain with meshcni but the pod is not redirected:\n%s", first(ta.unredirected, 10))
	}
	if len(ta.delErrs) > 0 {
		t.Errorf("failed DELs:\n%s", first(ta.delErrs, 10))
	}
	if len(ta.leftRules) > 0 {
		t.Errorf("meshcni's rules left after DEL:\n%s", first(ta.leftRules, 5))
	}
	if len(reads.bad) > 0 {
		t.Errorf("the configuration read badly:\n%s", strings.Join(reads.bad, "\n"))
	}
	if ta.started == 0 {
		t.Error("no ADD succeeded under the faults")
	}

	// The faults over, the agent puts its entry back and the chain works again.
	waitEntry(t, r, ds)
	if ta := r.churn(ctx, workers, workers, nil); ta.redirect != workers {
		t.Errorf("after the faults: %s\n%s", ta.summary(), first(ta.addErrs, 5))
	}
	if after := r.host(t); len(after.more(before)) > 0 {
		t.Errorf("left on the host: %s (before %+v, after %+v)", strings.Join(after.more(before), ", "), before, after)
	}
	if err := ds.stop(); err != nil {
		t.Errorf("last meshcni-agent on SIGTERM: %v\n%s", err, ds.lastLog())
	}
	got, err := os.ReadFile(filepath.Join(r.confDir, primaryName))
	if err != nil {
		t.Fatal(err)
	}
	var gv, wv any
	if json.Unmarshal(got, &gv) != nil || json.Unmarshal(r.primary, &wv) != nil || !reflect.DeepEqual(gv, wv) {
		t.Errorf("the primary's file after the agent's SIGTERM:\n%s\nwant\n%s", got, r.primary)
	}
}

// waitEntry waits until the configuration holds meshcni's entry and the plugin is
// installed.
func waitEntry(t *testing.T, r *rig, ds *daemonSet) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		l, _, err := r.loadList()
		_, binErr := os.Stat(filepath.Join(r.binDir, "meshcni"))
		if err == nil && hasMeshcni(l) && binErr == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("meshcni's entry not in the configuration within 60 s (%v, %v)\n%s", err, binErr, ds.lastLog())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// helperMaxPause is the longest pause of the plugin's API helper between two attempts.
var helperMaxPause = helper.NewPodClient(&helper.APIConfig{}).MaxBackoff

// entryAPITimeout is the api_timeout of meshcni's entry in the configuration.
func entryAPITimeout(t *testing.T, r *rig) time.Duration {
	t.Helper()
	l, _, err := r.loadList()
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range l.Plugins {
		if p.Network.Type != "meshcni" {
			continue
		}
		c, err := plugin.ParseConfig(p.Bytes)
		if err != nil {
			t.Fatalf("meshcni's entry: %v\n%s", err, p.Bytes)
		}
		return c.APITimeout
	}
	t.Fatal("no meshcni entry in the configuration")
	return 0
}

// spansText lists the outages' durations.
func spansText(spans []loadtest.Span) string {
	if len(spans) == 0 {
		return "no API server outage"
	}
	var ds []string
	for _, s := range spans {
		ds = append(ds, s.End.Sub(s.Start).Round(100*time.Millisecond).String())
	}
	return fmt.Sprintf("%d API server outages: %s", len(spans), strings.Join(ds, ", "))
}
