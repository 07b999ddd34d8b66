package proxysim

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httputil"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"sync"
)

// Stat names pilot-agent's readiness check reads from Envoy's admin /stats.
const (
	StatCDSSuccess     = "cluster_manager.cds.update_success"
	StatCDSRejected    = "cluster_manager.cds.update_rejected"
	StatLDSSuccess     = "listener_manager.lds.update_success"
	StatLDSRejected    = "listener_manager.lds.update_rejected"
	StatServerState    = "server.state"
	StatWorkersStarted = "listener_manager.workers_started"
	StatClusters       = "cluster_manager.active_clusters"
	StatListeners      = "listener_manager.total_listeners_active"
)

// Envoy's server states (server.state).
const (
	StateLive            = 0
	StatePreInitializing = 2
)

// EnvoyStats are the stand-in's Envoy stats: a name → value table where a stat is
// listed by ?usedonly once it has been set, as in Envoy.
type EnvoyStats struct {
	mu   sync.Mutex
	vals map[string]uint64
}

// NewEnvoyStats starts with server.state PRE_INITIALIZING.
func NewEnvoyStats() *EnvoyStats {
	return &EnvoyStats{vals: map[string]uint64{StatServerState: StatePreInitializing}}
}

// Add adds d to a counter (marking it used).
func (s *EnvoyStats) Add(name string, d uint64) {
	s.mu.Lock()
	s.vals[name] += d
	s.mu.Unlock()
}

// Set sets a gauge.
func (s *EnvoyStats) Set(name string, v uint64) {
	s.mu.Lock()
	s.vals[name] = v
	s.mu.Unlock()
}

// Get returns a stat's value and whether it was ever set.
func (s *EnvoyStats) Get(name string) (uint64, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	v, ok := s.vals[name]
	return v, ok
}

// Text renders the stats as Envoy's /stats does ("name: value", sorted), keeping the
// names that match filter (an RE2 expression, Envoy's ?filter=); nil keeps all.
func (s *EnvoyStats) Text(filter *regexp.Regexp) string {
	s.mu.Lock()
	names := make([]string, 0, len(s.vals))
	for n := range s.vals {
		if filter == nil || filter.MatchString(n) {
			names = append(names, n)
		}
	}
	slices.Sort(names)
	var b strings.Builder
	for _, n := range names {
		fmt.Fprintf(&b, "%s: %d\n", n, s.vals[n])
	}
	s.mu.Unlock()
	return b.String()
}

// adminHandler serves the admin endpoints pilot-agent and people call: /stats
// (?usedonly, ?filter=), /stats/prometheus, /ready, /server_info,
// /drain_listeners, /healthcheck/fail|ok, /quitquitquit, and the proxy's /records.
func (e *Envoy) adminHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/stats", func(w http.ResponseWriter, r *http.Request) {
		var filter *regexp.Regexp
		if f := r.URL.Query().Get("filter"); f != "" {
			var err error
			if filter, err = regexp.Compile(f); err != nil {
				http.Error(w, fmt.Sprintf("invalid regex: %v", err), http.StatusBadRequest)
				return
			}
		}
		w.Header().Set("Content-Type", "text/plain; charset=UTF-8")
		_, _ = io.WriteString(w, e.Stats.Text(filter))
	})
	mux.HandleFunc("/stats/prometheus", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4")
		for _, line := range strings.Split(strings.TrimSpace(e.Stats.Text(nil)), "\n") {
			name, val, ok := strings.Cut(line, ": ")
			if ok {
				fmt.Fprintf(w, "envoy_%s %s\n", strings.NewReplacer(".", "_", "-", "_").Replace(name), val)
			}
		}
	})
	mux.HandleFunc("/ready", func(w http.ResponseWriter, _ *http.Request) {
		st, _ := e.Stats.Get(StatServerState)
		if st != StateLive {
			http.Error(w, stateName(st), http.StatusServiceUnavailable)
			return
		}
		_, _ = io.WriteString(w, "LIVE\n")
	})
	mux.HandleFunc("/server_info", func(w http.ResponseWriter, _ *http.Request) {
		st, _ := e.Stats.Get(StatServerState)
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, "{\"version\":\"meshcni-envoy-standin\",\"state\":%q,\"command_line_options\":{\"drain_time\":\"%ds\"}}\n",
			stateName(st), int(e.Args.DrainTime.Seconds()))
	})
	mux.HandleFunc("POST /drain_listeners", func(w http.ResponseWriter, r *http.Request) {
		e.log.Info("drain_listeners", "query", r.URL.RawQuery)
		_, _ = io.WriteString(w, "OK\n")
	})
	mux.HandleFunc("POST /healthcheck/fail", func(w http.ResponseWriter, _ *http.Request) {
		e.Stats.Set(StatServerState, 1) // DRAINING
		_, _ = io.WriteString(w, "OK\n")
	})
	mux.HandleFunc("POST /healthcheck/ok", func(w http.ResponseWriter, _ *http.Request) {
		e.Stats.Set(StatServerState, StateLive)
		_, _ = io.WriteString(w, "OK\n")
	})
	mux.HandleFunc("POST /quitquitquit", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, "OK\n")
		e.quit()
	})
	if e.proxy != nil {
		mux.Handle("GET /records", e.proxy.AdminHandler())
	}
	return mux
}

func stateName(st uint64) string {
	switch st {
	case StateLive:
		return "LIVE"
	case 1:
		return "DRAINING"
	case StatePreInitializing:
		return "PRE_INITIALIZING"
	default:
		return "INITIALIZING"
	}
}

// healthHandler is the bootstrap's health listener: /healthz/ready goes to the
// agent cluster (pilot-agent's status port), everything else is 404, as the
// listener's single route says.
func healthHandler(agent *url.URL) http.Handler {
	rp := httputil.NewSingleHostReverseProxy(agent)
	mux := http.NewServeMux()
	mux.Handle("/healthz/ready", rp)
	return mux
}
