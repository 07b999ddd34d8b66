package agent

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/meshcni/meshcni/pkg/agentsock"
)

// Metrics are the agent's Prometheus metrics, in a registry of their own.
type Metrics struct {
	Registry          *prometheus.Registry
	Installs          *prometheus.CounterVec
	Ready             prometheus.Gauge
	Reinjections      prometheus.Counter
	Conflicts         *prometheus.CounterVec
	PluginCommands    *prometheus.CounterVec
	PluginAddDuration *prometheus.HistogramVec
	TokenExpiry       prometheus.Gauge
	TokenRenewals     *prometheus.CounterVec
	// ConfigInvalid is 1 per configuration file that does not load while it does not;
	// ConfigInvalidEpisodes counts the times a file was found so.
	ConfigInvalid         *prometheus.GaugeVec
	ConfigInvalidEpisodes *prometheus.CounterVec
}

// NewMetrics registers the agent's metrics in a new registry.
func NewMetrics() *Metrics {
	m := &Metrics{
		Registry: prometheus.NewRegistry(),
		Installs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshcni_agent_installs_total",
			Help: "Writes of the plugin's binary, kubeconfig or configuration, by result (success, error).",
		}, []string{"result"}),
		Ready: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "meshcni_agent_ready",
			Help: "1 when the plugin's binary, kubeconfig and configuration entry are in place.",
		}),
		Reinjections: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "meshcni_agent_reinjections_total",
			Help: "Times meshcni's entry was put back after someone removed it.",
		}),
		Conflicts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshcni_agent_conflicts_total",
			Help: "Times another writer was found fighting over a CNI configuration file, by file.",
		}, []string{"file"}),
		PluginCommands: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshcni_plugin_cmd_total",
			Help: "CNI commands run by the plugin on this node, by command and result.",
		}, []string{"command", "result"}),
		PluginAddDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "meshcni_plugin_add_duration_seconds",
			Help:    "Duration of the plugin's CNI ADD, by result.",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5},
		}, []string{"result"}),
		TokenExpiry: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "meshcni_agent_plugin_token_expiry_timestamp_seconds",
			Help: "Unix time at which the plugin's current token expires (0: none minted, or the plugin uses the agent's own token).",
		}),
		TokenRenewals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshcni_agent_plugin_token_renewals_total",
			Help: "TokenRequests for the plugin's token, by result (success, error).",
		}, []string{"result"}),
		ConfigInvalid: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "meshcni_agent_cni_config_invalid",
			Help: "1 for each CNI configuration file read before the primary (or the named primary) that does not load, e.g. half-written; the agent leaves it alone until it is valid.",
		}, []string{"file"}),
		ConfigInvalidEpisodes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshcni_agent_cni_config_invalid_episodes_total",
			Help: "Times a CNI configuration file was found not loading (each episode counted once), by file.",
		}, []string{"file"}),
	}
	m.Registry.MustRegister(m.Installs, m.Ready, m.Reinjections, m.Conflicts, m.PluginCommands, m.PluginAddDuration, m.TokenExpiry, m.TokenRenewals,
		m.ConfigInvalid, m.ConfigInvalidEpisodes,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	for _, r := range []string{"success", "error"} {
		m.Installs.WithLabelValues(r)
		m.TokenRenewals.WithLabelValues(r)
	}
	return m
}

// ObserveCommand records a command result sent by the plugin; unknown label values
// become "other", so a plugin cannot blow up the series count.
func (m *Metrics) ObserveCommand(r *agentsock.CommandResult) {
	cmd, res := r.Command, r.Result
	switch cmd {
	case agentsock.CommandAdd, agentsock.CommandDel, agentsock.CommandCheck, "GC", "STATUS", "VERSION":
	default:
		cmd = "other"
	}
	switch res {
	case agentsock.ResultSuccess, agentsock.ResultError:
	default:
		res = "other"
	}
	m.PluginCommands.WithLabelValues(cmd, res).Inc()
	if cmd == agentsock.CommandAdd && r.Seconds >= 0 {
		m.PluginAddDuration.WithLabelValues(res).Observe(r.Seconds)
	}
}
