// Package buildinfo is what a meshcni command says about its build: the JSON of
// GET /version on its health server. The meshcni_build_info gauge is in
// buildinfo/buildmetrics, so that a command without metrics (meshcnictl) reads
// Info without linking the Prometheus client.
package buildinfo

import (
	"encoding/json"
	"net/http"
	"runtime"
)

// Info is a build's identity, as GET /version serves it.
type Info struct {
	// Version is the command's main.version, set with -ldflags "-X main.version=...".
	Version string `json:"version"`
	// GoVersion is the Go release the command was built with (runtime.Version()).
	GoVersion string `json:"goVersion"`
	// Platform is GOOS/GOARCH, e.g. linux/amd64.
	Platform string `json:"platform"`
}

// New returns the running binary's Info for version ("dev" when empty).
func New(version string) Info {
	if version == "" {
		version = "dev"
	}
	return Info{Version: version, GoVersion: runtime.Version(), Platform: runtime.GOOS + "/" + runtime.GOARCH}
}

// Handler serves Info as JSON.
func (i Info) Handler() http.Handler {
	body, _ := json.Marshal(i) // three strings: cannot fail
	return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(append(body, '\n'))
	})
}
