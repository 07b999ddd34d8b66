package taint

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// Metrics are the controller's Prometheus metrics, in a registry of their own.
type Metrics struct {
	Registry *prometheus.Registry
	// Changes counts taint writes that changed a node, by action (add, remove).
	Changes *prometheus.CounterVec
	// Errors counts failed reconciles of a node (retried with backoff).
	Errors prometheus.Counter
	// Leader is 1 while this replica leads (acts on nodes).
	Leader prometheus.Gauge
	// BreakerTrips counts the times the breaker opened.
	BreakerTrips prometheus.Counter
	// Marks counts the nodes on which this replica recorded MarkAnnotation.
	Marks prometheus.Counter
}

// NewMetrics registers the metrics in a new registry. tainted and breaker are read at
// every scrape: the number of managed nodes carrying the taint, as this replica's cache
// sees them; whether the breaker is open (1 or 0) and how many nodes' taints it
// withholds.
func NewMetrics(tainted func() float64, breaker func() (open, withheld float64)) *Metrics {
	m := &Metrics{
		Registry: prometheus.NewRegistry(),
		Changes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshcni_taint_changes_total",
			Help: "Taint writes by this replica that changed a node, by action (add, remove).",
		}, []string{"action"}),
		Errors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "meshcni_taint_reconcile_errors_total",
			Help: "Reconciles of a node that failed and were retried with backoff.",
		}),
		Leader: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "meshcni_taint_leader",
			Help: "1 while this replica is the leader, the only one that writes taints.",
		}),
		BreakerTrips: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "meshcni_taint_breaker_trips_total",
			Help: "Times the breaker opened: a taint was due that would have put more nodes than --max-tainted-fraction under the taint.",
		}),
		Marks: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "meshcni_taint_marks_total",
			Help: "Nodes on which this replica recorded that their agent was Ready (the annotation " + MarkAnnotation + ").",
		}),
	}
	open := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "meshcni_taint_breaker_open",
		Help: "1 while the breaker is open: the leader adds no taint (it still removes taints); 0 when closed or not leading.",
	}, func() float64 { o, _ := breaker(); return o })
	withheld := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "meshcni_taint_withheld_nodes",
		Help: "Managed nodes due the taint that the open breaker leaves untainted (leader only).",
	}, func() float64 { _, w := breaker(); return w })
	nodes := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "meshcni_taint_nodes_tainted",
		Help: "Managed nodes carrying the taint cni.istio.io/not-ready:NoSchedule (this replica's cache; every replica reports it).",
	}, tainted)
	m.Registry.MustRegister(m.Changes, m.Errors, m.Leader, nodes, m.BreakerTrips, m.Marks, open, withheld,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	for _, a := range []Action{Add, Remove} {
		m.Changes.WithLabelValues(a.String())
	}
	return m
}
