// Package loadtest holds meshcni's load-and-fault campaign (issue 14): a burst of
// meshed pods on the test bed's node, ADD/DEL churn through libcni with the agent
// answering, and the same churn under faults (the agent SIGKILLed, the primary CNI
// rewriting its conflist, the API server restarted). The tests are in the _test
// files; this file holds the pure parts they share: /proc sampling, the conflist
// audit, the counts from the environment, and the tables they log.
package loadtest

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Count reads a positive integer from the environment variable name, or returns def
// when it is unset. A set but invalid value is an error naming the variable.
func Count(name string, def int) (int, error) {
	s, ok := os.LookupEnv(name)
	if !ok || s == "" {
		return def, nil
	}
	n, err := strconv.Atoi(s)
	if err != nil || n <= 0 {
		return 0, fmt.Errorf("%s=%q: want a positive integer", name, s)
	}
	return n, nil
}

// Duration reads a positive duration from the environment variable name, or returns
// def when it is unset.
func Duration(name string, def time.Duration) (time.Duration, error) {
	s, ok := os.LookupEnv(name)
	if !ok || s == "" {
		return def, nil
	}
	d, err := time.ParseDuration(s)
	if err != nil || d <= 0 {
		return 0, fmt.Errorf("%s=%q: want a positive duration such as 3s", name, s)
	}
	return d, nil
}

// MeshcniEntries returns how many plugins of type "meshcni" a conflist holds. A
// document that is not a JSON conflist with a plugins array is an error.
func MeshcniEntries(data []byte) (int, error) {
	var l struct {
		Plugins []struct {
			Type string `json:"type"`
		} `json:"plugins"`
	}
	if err := json.Unmarshal(data, &l); err != nil {
		return 0, fmt.Errorf("not valid JSON: %w", err)
	}
	if l.Plugins == nil {
		return 0, fmt.Errorf("no plugins array")
	}
	n := 0
	for _, p := range l.Plugins {
		if p.Type == "meshcni" {
			n++
		}
	}
	return n, nil
}

// Sample is one reading of a process from /proc.
type Sample struct {
	// At is the label of the sample (e.g. "cycle 1000").
	At string
	// FDs is the number of entries in /proc/PID/fd.
	FDs int
	// Threads is Threads: of /proc/PID/status.
	Threads int
	// RSS is VmRSS of /proc/PID/status, in bytes.
	RSS int64
	// Goroutines is go_goroutines from the process's /metrics (-1 when unknown).
	Goroutines int
}

// ReadProc reads FDs, Threads and RSS of pid from procRoot (normally "/proc").
func ReadProc(procRoot string, pid int) (Sample, error) {
	dir := filepath.Join(procRoot, strconv.Itoa(pid))
	fds, err := os.ReadDir(filepath.Join(dir, "fd"))
	if err != nil {
		return Sample{}, fmt.Errorf("read fds of %d: %w", pid, err)
	}
	st, err := os.ReadFile(filepath.Join(dir, "status"))
	if err != nil {
		return Sample{}, fmt.Errorf("read status of %d: %w", pid, err)
	}
	s := Sample{FDs: len(fds), Goroutines: -1}
	for _, line := range strings.Split(string(st), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		f := strings.Fields(v)
		if len(f) == 0 {
			continue
		}
		switch k {
		case "Threads":
			if s.Threads, err = strconv.Atoi(f[0]); err != nil {
				return Sample{}, fmt.Errorf("parse Threads %q of %d: %w", v, pid, err)
			}
		case "VmRSS":
			kb, err := strconv.ParseInt(f[0], 10, 64)
			if err != nil {
				return Sample{}, fmt.Errorf("parse VmRSS %q of %d: %w", v, pid, err)
			}
			s.RSS = kb * 1024
		}
	}
	if s.Threads == 0 || s.RSS == 0 {
		return Sample{}, fmt.Errorf("no Threads or VmRSS in %s/status", dir)
	}
	return s, nil
}

// Table renders samples as a Markdown table.
func Table(samples []Sample) string {
	var b strings.Builder
	b.WriteString("| when | fds | goroutines | threads | RSS (MiB) |\n|---|---|---|---|---|\n")
	for _, s := range samples {
		g := "?"
		if s.Goroutines >= 0 {
			g = strconv.Itoa(s.Goroutines)
		}
		fmt.Fprintf(&b, "| %s | %d | %s | %d | %.1f |\n", s.At, s.FDs, g, s.Threads, float64(s.RSS)/(1<<20))
	}
	return b.String()
}

// Percentiles returns the p50, p99 and maximum of ds (zeros when empty).
func Percentiles(ds []time.Duration) (p50, p99, maxd time.Duration) {
	if len(ds) == 0 {
		return 0, 0, 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	at := func(q float64) time.Duration { return s[min(len(s)-1, int(q*float64(len(s))))] }
	return at(0.50), at(0.99), s[len(s)-1]
}

// Span is a stretch of time, such as one fault from its start to its end.
type Span struct{ Start, End time.Time }

// MaxFailedADDs is the most ADDs that the API server's outages can fail, derived from
// the outages alone. An ADD fails only when its pod lookup finds neither the agent nor
// the API server: the plugin's helper retries the API server until apiTimeout, pausing
// at most maxPause between attempts, so a failing ADD spends at least apiTimeout −
// maxPause inside one outage, and outages less than maxPause apart count as one. Each
// of the workers runs its ADDs one after the other, so an outage of d fails at most
// ⌊d / (apiTimeout − maxPause)⌋ ADDs of each. apiTimeout must exceed maxPause.
func MaxFailedADDs(outages []Span, apiTimeout, maxPause time.Duration, workers int) (int, error) {
	need := apiTimeout - maxPause
	if need <= 0 {
		return 0, fmt.Errorf("api_timeout %v is not longer than the helper's pause between attempts (%v): any outage can fail every ADD", apiTimeout, maxPause)
	}
	n := 0
	for _, s := range mergeSpans(outages, maxPause) {
		n += int(s.End.Sub(s.Start) / need)
	}
	return n * workers, nil
}

// mergeSpans sorts the spans and joins those less than gap apart.
func mergeSpans(spans []Span, gap time.Duration) []Span {
	s := slices.Clone(spans)
	slices.SortFunc(s, func(a, b Span) int { return a.Start.Compare(b.Start) })
	var out []Span
	for _, sp := range s {
		if last := len(out) - 1; last >= 0 && sp.Start.Sub(out[last].End) < gap {
			if sp.End.After(out[last].End) {
				out[last].End = sp.End
			}
			continue
		}
		out = append(out, sp)
	}
	return out
}
