package main

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/meshcni/meshcni/internal/env/istio"
	"github.com/meshcni/meshcni/internal/env/testbed"
)

// istioNamespace holds the app the real injector meshes.
const istioNamespace = "istio-demo"

// runIstio installs the real Istio next to the demo's meshcni, (re)creates the app in
// istioNamespace and prints what istiod injected and what the proxies captured.
func runIstio(ctx context.Context, log *slog.Logger, tb *testbed.Testbed, dir string) error {
	inst, err := istio.Up(ctx, tb, istio.Options{RepoRoot: dir, Log: log, SkipMeshcni: true})
	if err != nil {
		return err
	}
	if err := istio.DeleteNamespace(ctx, tb, istioNamespace); err != nil {
		return err
	}
	app, err := istio.StartApp(ctx, tb, istioNamespace)
	if err != nil {
		return err
	}
	tr, err := app.Probe(ctx, tb)
	if err != nil {
		return err
	}
	fmt.Printf("\nReal Istio %s (%s): istiod with its injector (pilot.cni.enabled=true), pilot-agent in every pod\n", inst.Build.Version, inst.Build.Release)
	for _, p := range []*corev1.Pod{app.Server, app.Client} {
		fmt.Printf("  %-28s %-12s sidecar.istio.io/status %s\n", p.Name, p.Status.PodIP, p.Annotations["sidecar.istio.io/status"])
	}
	fmt.Printf("  both Ready (pilot-agent's :15021/healthz/ready) %s after the Deployments were created\n", app.Ready.Round(time.Millisecond))
	fmt.Printf("  %s → %v (uid %d): reply %q\n", app.Client.Name, tr.Dst, tr.Probe.UID, tr.Probe.Reply)
	fmt.Printf("  client proxy: accepted on %v, original destination %v, forwarded from %v as uid %d\n", tr.Outbound.Local, tr.Outbound.OrigDst, tr.Outbound.ForwardSource, tr.Outbound.UID)
	fmt.Printf("  server proxy: accepted on %v from %v, original destination %v, forwarded from %v\n", tr.Inbound.Local, tr.Inbound.Peer, tr.Inbound.OrigDst, tr.Inbound.ForwardSource)
	fmt.Printf("  explore: kubectl -n %s get pods; kubectl -n %s logs deploy/client -c istio-proxy\n", istioNamespace, istioNamespace)
	return nil
}
