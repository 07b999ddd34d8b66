package demo

import (
	"context"
	"net/netip"
	"time"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/tools/build/image"
)

// Install builds and imports the meshcni image and installs meshcni with its own
// chart on tb, as the demo does (the agent DaemonSet ready, the plugin in the node's
// CNI configuration, the node untainted), without the demo app. Down removes it.
func Install(ctx context.Context, tb *testbed.Testbed, o Options) (*image.Result, error) {
	o.defaults()
	r := &runner{o: o, tb: tb, rep: &Report{}, ips: map[string]netip.Addr{}, last: time.Now()}
	if err := r.install(ctx); err != nil {
		return r.rep.Image, err
	}
	return r.rep.Image, nil
}

// HelmPath is the Helm binary the demo runs: $MESHCNI_HELM, or `hack/helm --path`.
func HelmPath(ctx context.Context, repoRoot string) (string, error) {
	return helmPath(ctx, repoRoot)
}
