package loadtest_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/vishvananda/netlink"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/suites/loadtest"
	"github.com/meshcni/meshcni/internal/testkit/agenttest"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
)

func TestMain(m *testing.M) {
	code := testbed.RunMain(m)
	agenttest.RemoveBinaries()
	os.Exit(code)
}

// Environment knobs: the CI-sized defaults (ciCycles, ciFaultCycles, ciBurst) keep `make e2e` fast;
// the figures in docs/performance.md come from the sizes its commands name.
const (
	envCycles  = "MESHCNI_LOAD_CYCLES"
	envWorkers = "MESHCNI_LOAD_WORKERS"
	// ciCycles is TestChurn's number of ADD/DEL cycles by default; ciFaultCycles
	// TestChurnFaults', long enough for a few API server restarts (each takes ~12 s).
	ciCycles      = 150
	ciFaultCycles = 300
)

func counts(t *testing.T, defCycles int) (cycles, workers int) {
	t.Helper()
	var err error
	if cycles, err = loadtest.Count(envCycles, defCycles); err != nil {
		t.Fatal(err)
	}
	if workers, err = loadtest.Count(envWorkers, 4); err != nil {
		t.Fatal(err)
	}
	return cycles, workers
}

// tally is what a churn run found, cycle by cycle.
type tally struct {
	mu                                sync.Mutex
	cycles, started, redirect         int
	addErrs, delErrs                  []string
	unredirected, leftRules           []string
	withoutEntry, withoutEntryStarted int
	adds, dels                        []int64
}

func (ta *tally) add(pod string, o outcome) {
	ta.mu.Lock()
	defer ta.mu.Unlock()
	ta.cycles++
	if o.addErr != nil {
		ta.addErrs = append(ta.addErrs, fmt.Sprintf("%s: %v", pod, o.addErr))
	}
	if o.delErr != nil {
		ta.delErrs = append(ta.delErrs, fmt.Sprintf("%s: %v", pod, o.delErr))
	}
	if !o.listHadMeshcni {
		ta.withoutEntry++
		if o.started {
			ta.withoutEntryStarted++
		}
	}
	if o.started {
		ta.started++
		if o.redirected {
			ta.redirect++
		} else if o.listHadMeshcni {
			ta.unredirected = append(ta.unredirected, fmt.Sprintf("%s: %s", pod, o.drift))
		}
	}
	if o.leftRules != "" {
		ta.leftRules = append(ta.leftRules, fmt.Sprintf("%s: %s", pod, o.leftRules))
	}
	ta.adds = append(ta.adds, int64(o.add))
	ta.dels = append(ta.dels, int64(o.del))
}

func durations(ns []int64) []time.Duration {
	out := make([]time.Duration, len(ns))
	for i, n := range ns {
		out[i] = time.Duration(n)
	}
	return out
}

func (ta *tally) summary() string {
	ta.mu.Lock()
	defer ta.mu.Unlock()
	a50, a99, amax := loadtest.Percentiles(durations(ta.adds))
	d50, d99, dmax := loadtest.Percentiles(durations(ta.dels))
	return fmt.Sprintf("cycles %d: ADD ok %d (redirected %d), ADD failed %d, DEL failed %d, started unredirected %d, rules left after DEL %d; "+
		"ADDs on a conflist without meshcni's entry %d (of which returned success %d); "+
		"ADD p50 %v p99 %v max %v; DEL p50 %v p99 %v max %v",
		ta.cycles, ta.started, ta.redirect, len(ta.addErrs), len(ta.delErrs), len(ta.unredirected), len(ta.leftRules),
		ta.withoutEntry, ta.withoutEntryStarted,
		a50.Round(time.Millisecond/10), a99.Round(time.Millisecond/10), amax.Round(time.Millisecond),
		d50.Round(time.Millisecond/10), d99.Round(time.Millisecond/10), dmax.Round(time.Millisecond))
}

func first(list []string, n int) string {
	if len(list) > n {
		return strings.Join(list[:n], "\n") + fmt.Sprintf("\n… and %d more", len(list)-n)
	}
	return strings.Join(list, "\n")
}

// churn runs cycles ADD/DEL cycles with workers in parallel, calling progress (if
// set) after every tenth of them.
func (r *rig) churn(ctx context.Context, cycles, workers int, progress func(done int)) *tally {
	ta := &tally{}
	f := r.feed(ctx, cycles, 4*workers)
	var wg sync.WaitGroup
	var mu sync.Mutex
	done := 0
	step := max(cycles/10, 1)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for pod := range f.ch {
				o := r.cycle(ctx, pod)
				ta.add(pod.Name, o)
				f.del <- pod.Name
				mu.Lock()
				done++
				n := done
				mu.Unlock()
				if progress != nil && n%step == 0 {
					progress(n)
				}
			}
		}()
	}
	wg.Wait()
	f.done()
	return ta
}

// hostState is what the chain could leave behind on the host.
type hostState struct {
	netns, nsMounts, veths, ipamFiles, cacheFiles, routes, nftLines int
}

// more lists what h holds more of than before: what a run left on the host. Fewer is
// no leak (the host-wide route count also falls when the test bed's own pods of an
// earlier test finish terminating meanwhile).
func (h hostState) more(before hostState) []string {
	var left []string
	for _, c := range []struct {
		name      string
		now, then int
	}{
		{"netns", h.netns, before.netns}, {"netns mounts", h.nsMounts, before.nsMounts}, {"veths", h.veths, before.veths},
		{"IPAM files", h.ipamFiles, before.ipamFiles}, {"libcni cache files", h.cacheFiles, before.cacheFiles},
		{"routes", h.routes, before.routes}, {"nft ruleset lines", h.nftLines, before.nftLines},
	} {
		if c.now > c.then {
			left = append(left, fmt.Sprintf("%d more %s", c.now-c.then, c.name))
		}
	}
	return left
}

func (r *rig) host(t *testing.T) hostState {
	t.Helper()
	var h hostState
	if ents, err := os.ReadDir("/run/netns"); err == nil {
		for _, e := range ents {
			if strings.HasPrefix(e.Name(), "mcni-load-") {
				h.netns++
			}
		}
	}
	if b, err := os.ReadFile("/proc/self/mountinfo"); err == nil {
		h.nsMounts = strings.Count(string(b), "/mcni-load-")
	}
	if br, err := netlink.LinkByName(loadBridge); err == nil {
		links, err := netlink.LinkList()
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range links {
			if l.Attrs().MasterIndex == br.Attrs().Index {
				h.veths++
			}
		}
	}
	h.ipamFiles = countFiles(t, r.ipamDir, func(name string) bool {
		return name != "lock" && !strings.HasPrefix(name, "last_reserved_ip")
	})
	h.cacheFiles = countFiles(t, r.cacheDir, func(string) bool { return true })
	routes, err := netlink.RouteListFiltered(netlink.FAMILY_ALL, &netlink.Route{Table: 0}, 0)
	if err != nil {
		t.Fatal(err)
	}
	h.routes = len(routes)
	if nft, err := exec.LookPath("nft"); err == nil {
		out, err := exec.Command(nft, "list", "ruleset").CombinedOutput()
		if err != nil {
			t.Fatalf("nft list ruleset: %v\n%s", err, out)
		}
		h.nftLines = strings.Count(string(out), "\n")
	}
	return h
}

func countFiles(t *testing.T, dir string, keep func(string) bool) int {
	t.Helper()
	n := 0
	err := filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() && keep(d.Name()) {
			n++
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// sampleAgent reads the agent's fds, threads and RSS from /proc and its goroutines
// from /metrics.
func sampleAgent(t *testing.T, pid int, metricsURL, at string) loadtest.Sample {
	t.Helper()
	s, err := loadtest.ReadProc("/proc", pid)
	if err != nil {
		t.Fatal(err)
	}
	s.At = at
	if code, body, err := agenttest.Get(metricsURL); err == nil && code == 200 {
		for _, line := range strings.Split(body, "\n") {
			var g int
			if _, err := fmt.Sscanf(line, "go_goroutines %d", &g); err == nil {
				s.Goroutines = g
			}
		}
	}
	return s
}

// pluginErrors sums meshcni_plugin_cmd_total samples whose result is not success.
func pluginErrors(fams map[string]*dto.MetricFamily) (errs, total float64) {
	fam, ok := fams["meshcni_plugin_cmd_total"]
	if !ok {
		return 0, 0
	}
	for _, m := range fam.Metric {
		v := m.GetCounter().GetValue()
		total += v
		for _, l := range m.Label {
			if l.GetName() == "result" && l.GetValue() != "success" {
				errs += v
			}
		}
	}
	return errs, total
}

// TestChurn: ADD/DEL cycles through libcni, the agent answering the plugin's pod
// lookups: every ADD succeeds and redirects, every DEL succeeds and leaves no rule,
// nothing is left on the host, and the agent's fds, goroutines and RSS are flat
// (the table is logged).
func TestChurn(t *testing.T) {
	testutil.RequireRoot(t)
	cycles, workers := counts(t, ciCycles)
	tb := testbed.API(t)
	r := newRig(t, tb)
	a := agenttest.Start(t, agenttest.Options{ConfDir: r.confDir, BinDir: r.binDir, NodeName: r.node})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Hour)
	defer cancel()

	// Warm-up: the bridge exists, the agent has served once.
	if ta := r.churn(ctx, workers, workers, nil); len(ta.addErrs)+len(ta.delErrs)+len(ta.unredirected) > 0 {
		t.Fatalf("warm-up: %s\n%s\n%s", ta.summary(), first(ta.addErrs, 5), first(ta.unredirected, 5))
	}
	time.Sleep(2 * time.Second) // released fds linger 1 s in the agent
	before := r.host(t)
	samples := []loadtest.Sample{sampleAgent(t, a.PID, a.MetricsURL, "before (idle)")}
	var smu sync.Mutex
	began := time.Now()
	ta := r.churn(ctx, cycles, workers, func(n int) {
		s := sampleAgent(t, a.PID, a.MetricsURL, fmt.Sprintf("cycle %d", n))
		smu.Lock()
		samples = append(samples, s)
		smu.Unlock()
	})
	took := time.Since(began)
	time.Sleep(3 * time.Second)
	samples = append(samples, sampleAgent(t, a.PID, a.MetricsURL, "after (idle, 3 s)"))
	after := r.host(t)
	t.Logf("%d cycles, %d workers, %v (%.0f cycles/s): %s", cycles, workers, took.Round(time.Second), float64(cycles)/took.Seconds(), ta.summary())
	t.Logf("meshcni-agent (pid %d), sampled from /proc and /metrics:\n%s", a.PID, loadtest.Table(samples))
	t.Logf("host before %+v after %+v", before, after)

	if len(ta.addErrs)+len(ta.delErrs) > 0 {
		t.Errorf("failed commands:\n%s\n%s", first(ta.addErrs, 10), first(ta.delErrs, 10))
	}
	if len(ta.unredirected) > 0 || ta.redirect != cycles {
		t.Errorf("%d of %d ADDs redirected; started unredirected:\n%s", ta.redirect, cycles, first(ta.unredirected, 10))
	}
	if len(ta.leftRules) > 0 {
		t.Errorf("meshcni's rules left after DEL:\n%s", first(ta.leftRules, 5))
	}
	if ta.withoutEntry > 0 {
		t.Errorf("%d ADDs read a conflist without meshcni's entry while nothing rewrote it", ta.withoutEntry)
	}
	if left := after.more(before); len(left) > 0 {
		t.Errorf("left on the host: %s (before %+v, after %+v)", strings.Join(left, ", "), before, after)
	}
	if errs, total := pluginErrors(a.Metrics(t)); errs > 0 {
		t.Errorf("the agent counted %v failed plugin commands of %v", errs, total)
	}
	b, e := samples[0], samples[len(samples)-1]
	if e.FDs > b.FDs+4 {
		t.Errorf("agent fds %d → %d: a descriptor leak", b.FDs, e.FDs)
	}
	if e.Goroutines > b.Goroutines+10 {
		t.Errorf("agent goroutines %d → %d: a goroutine leak", b.Goroutines, e.Goroutines)
	}
	if e.RSS > b.RSS+32<<20 {
		t.Errorf("agent RSS %.1f → %.1f MiB", float64(b.RSS)/(1<<20), float64(e.RSS)/(1<<20))
	}
}
