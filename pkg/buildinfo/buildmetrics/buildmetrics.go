// Package buildmetrics is the meshcni_build_info gauge of a meshcni command that
// serves metrics (the agent, the taint controller), apart from buildinfo so that
// commands without metrics do not link the Prometheus client.
package buildmetrics

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshcni/meshcni/pkg/buildinfo"
)

// Collector is the gauge meshcni_build_info{version, goversion} = 1.
func Collector(i buildinfo.Info) prometheus.Collector {
	g := prometheus.NewGauge(prometheus.GaugeOpts{
		Name:        "meshcni_build_info",
		Help:        "1, labelled with the version of the running binary and the Go release it was built with.",
		ConstLabels: prometheus.Labels{"version": i.Version, "goversion": i.GoVersion},
	})
	g.Set(1)
	return g
}
