package istio

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/yaml"

	"github.com/meshcni/meshcni/internal/env/demo"
	"github.com/meshcni/meshcni/internal/env/testbed"
)

// Helm releases and namespace of Istio.
const (
	Namespace      = "istio-system"
	BaseRelease    = "istio-base"
	IstiodRelease  = "istiod"
	IstiodName     = "istiod"
	IstiodHost     = "istiod.istio-system.svc"
	hostAliasesTpl = HostAliasesTemplate
)

// HostAliasesTemplate is the injection template Values adds (listed in
// defaultTemplates, which the webhook applies): hostAliases for IstiodHost on the node
// IP. `istioctl kube-inject` applies only the "sidecar" template unless the pod's
// inject.istio.io/templates annotation names others, so offline injection on the test
// bed names both there.
const HostAliasesTemplate = "meshcni-testbed-hostaliases"

// Options configure Up and Down.
type Options struct {
	// RepoRoot is the meshcni module root.
	RepoRoot string
	Log      *slog.Logger
	// Timeout bounds each wait (3 minutes when zero).
	Timeout time.Duration
	// SkipMeshcni installs Istio only.
	SkipMeshcni bool
	// Reinstall is Up over a previous Up on the same test bed (its images imported,
	// Istio's base chart installed): only istiod and meshcni are upgraded.
	Reinstall bool
	// ExtraValues are merged over Values() for the istiod chart (maps merged key by
	// key, anything else replaced), e.g. {"pilot": {"taint": {"enabled": true}}}.
	ExtraValues map[string]any
	// ValuesFiles are values files for istiod's chart, given to helm after the
	// values above, in order (helm merges maps: a file adding an injection template
	// keeps the others).
	ValuesFiles []string
}

func (o *Options) defaults() {
	if o.Log == nil {
		o.Log = slog.Default()
	}
	if o.Timeout == 0 {
		o.Timeout = 3 * time.Minute
	}
}

// Step is one timed phase of Up.
type Step struct {
	Name string
	Took time.Duration
}

// Installed is what Up installed.
type Installed struct {
	Build Build
	Steps []Step
}

// Values returns the istiod chart's values: the CNI mode of the injector
// (pilot.cni.enabled), the proxy and istiod images built here, no cloud probe in
// pilot-agent, small requests for a 2-core node, and an injection template, listed in
// defaultTemplates, that gives every injected pod a hostAliases entry for istiod's
// name on the node IP (the test bed has no cluster DNS; istiod runs on the host
// network).
func Values() map[string]any {
	hostAliases := fmt.Sprintf("spec:\n  hostAliases:\n  - ip: %q\n    hostnames: [%q]\n", testbed.NodeIP, IstiodHost)
	return map[string]any{
		"hub": Hub, "tag": Tag,
		"autoscaleEnabled": false,
		"resources":        map[string]any{"requests": map[string]any{"cpu": "10m", "memory": "64Mi"}},
		"pilot":            map[string]any{"cni": map[string]any{"enabled": true}},
		"global": map[string]any{
			"hub": Hub, "tag": Tag, "imagePullPolicy": "Never",
			"proxy": map[string]any{"resources": map[string]any{"requests": map[string]any{"cpu": "10m", "memory": "32Mi"}}},
		},
		"meshConfig": map[string]any{
			"defaultConfig": map[string]any{"proxyMetadata": map[string]any{"CLOUD_PLATFORM": "none"}},
		},
		"sidecarInjectorWebhook": map[string]any{
			"templates":        map[string]any{hostAliasesTpl: hostAliases},
			"defaultTemplates": []string{"sidecar", hostAliasesTpl},
		},
	}
}

// mergeValues merges src over dst: maps key by key, anything else replaced.
func mergeValues(dst, src map[string]any) map[string]any {
	for k, v := range src {
		sub, ok := v.(map[string]any)
		if d, isMap := dst[k].(map[string]any); ok && isMap {
			dst[k] = mergeValues(d, sub)
			continue
		}
		dst[k] = v
	}
	return dst
}

type runner struct {
	o    Options
	tb   *testbed.Testbed
	helm string
	inst *Installed
	last time.Time
}

func (r *runner) step(name string) {
	now := time.Now()
	r.inst.Steps = append(r.inst.Steps, Step{Name: name, Took: now.Sub(r.last)})
	r.o.Log.Info("istio: "+name, "took", now.Sub(r.last).Round(time.Millisecond))
	r.last = now
}

// Up builds (or finds cached) Istio and its images, imports the images, installs
// Istio's base and istiod charts, puts istiod on the host network, waits for it, and
// installs meshcni with its own chart. It is idempotent (helm upgrade --install).
// With Options.Reinstall it upgrades istiod and meshcni only.
func Up(ctx context.Context, tb *testbed.Testbed, o Options) (*Installed, error) {
	o.defaults()
	if tb.Mode != testbed.ModeFull {
		return nil, fmt.Errorf("istio: the test bed runs %s; Istio needs a full node", tb.Mode)
	}
	r := &runner{o: o, tb: tb, inst: &Installed{}, last: time.Now()}
	if err := r.up(ctx); err != nil {
		return r.inst, err
	}
	return r.inst, nil
}

func (r *runner) up(ctx context.Context) error {
	b, err := EnsureBuilt(ctx, r.o.Log)
	if err != nil {
		return err
	}
	r.inst.Build = b
	r.step("istio " + b.Version + " built")
	if !r.o.Reinstall {
		if err := r.images(ctx, b); err != nil {
			return err
		}
	}
	if r.helm, err = demo.HelmPath(ctx, r.o.RepoRoot); err != nil {
		return err
	}
	if err := r.installIstio(ctx, b); err != nil {
		return err
	}
	if r.o.SkipMeshcni {
		return nil
	}
	if _, err := demo.Install(ctx, r.tb, demo.Options{RepoRoot: r.o.RepoRoot, Log: r.o.Log, Keep: true, Timeout: r.o.Timeout}); err != nil {
		return fmt.Errorf("install meshcni: %w", err)
	}
	r.step("meshcni installed with deploy/charts/meshcni")
	return nil
}

// images builds (or finds cached) Istio's images and imports them into the test bed.
func (r *runner) images(ctx context.Context, b Build) error {
	archive, err := Images(ctx, r.o.Log, b)
	if err != nil {
		return err
	}
	r.step("images built")
	if err := testbed.ImportImage(ctx, archive); err != nil {
		return err
	}
	r.step("images imported")
	return nil
}

func (r *runner) installIstio(ctx context.Context, b Build) error {
	if !r.o.Reinstall {
		if _, err := r.runHelm(ctx, "upgrade", "--install", BaseRelease, b.Chart("base"),
			"--namespace", Namespace, "--create-namespace", "--wait"); err != nil {
			return err
		}
		r.step("helm " + BaseRelease + " (Istio's base chart)")
	}
	vals, err := yaml.Marshal(mergeValues(Values(), r.o.ExtraValues))
	if err != nil {
		return err
	}
	vf := filepath.Join(os.TempDir(), fmt.Sprintf("meshcni-istiod-values-%d.yaml", os.Getpid()))
	if err := os.WriteFile(vf, vals, 0o600); err != nil {
		return err
	}
	defer os.Remove(vf)
	args := []string{"upgrade", "--install", IstiodRelease, b.Chart("istio-discovery"), "--namespace", Namespace, "--values", vf}
	for _, f := range r.o.ValuesFiles {
		args = append(args, "--values", f)
	}
	if _, err := r.runHelm(ctx, args...); err != nil {
		return err
	}
	r.step("helm " + IstiodRelease + " (Istio's istio-discovery chart, pilot.cni.enabled=true)")
	if err := r.hostNetwork(ctx); err != nil {
		return err
	}
	wctx, cancel := context.WithTimeout(ctx, r.o.Timeout)
	defer cancel()
	if err := r.waitIstiod(wctx); err != nil {
		return err
	}
	r.step("istiod ready (host network)")
	return nil
}

// hostNetwork patches istiod's Deployment onto the host network with the API server's
// address (pods on the pod network cannot reach the API server here), with the Recreate
// strategy: on one node a second host-network istiod cannot bind the first one's ports,
// so an upgrade (new values) replaces the pod instead of surging.
func (r *runner) hostNetwork(ctx context.Context) error {
	env := testbed.APIServerEnv()
	patch := map[string]any{"spec": map[string]any{
		"strategy": map[string]any{"type": string(appsv1.RecreateDeploymentStrategyType), "rollingUpdate": nil},
		"template": map[string]any{"spec": map[string]any{
			"hostNetwork": true,
			"dnsPolicy":   string(corev1.DNSClusterFirstWithHostNet),
			"containers":  []any{map[string]any{"name": "discovery", "env": env}},
		}}}}
	pb, err := json.Marshal(patch)
	if err != nil {
		return err
	}
	_, err = r.tb.Client.AppsV1().Deployments(Namespace).Patch(ctx, IstiodName, types.StrategicMergePatchType, pb, metav1.PatchOptions{})
	if err != nil {
		return fmt.Errorf("patch %s/%s onto the host network: %w", Namespace, IstiodName, err)
	}
	return nil
}

// waitIstiod waits for the patched Deployment's rollout, and for the injector's
// webhook to carry a CA bundle (istiod writes it once it serves).
func (r *runner) waitIstiod(ctx context.Context) error {
	for {
		d, err := r.tb.Client.AppsV1().Deployments(Namespace).Get(ctx, IstiodName, metav1.GetOptions{})
		if err == nil && rolledOut(d) && r.webhookReady(ctx) == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("istiod not ready: %w\n%s", ctx.Err(), r.istiodDiagnosis(context.WithoutCancel(ctx)))
		case <-time.After(250 * time.Millisecond):
		}
	}
}

func rolledOut(d *appsv1.Deployment) bool {
	want := int32(1)
	if d.Spec.Replicas != nil {
		want = *d.Spec.Replicas
	}
	s := d.Status
	return s.ObservedGeneration >= d.Generation && s.UpdatedReplicas == want && s.ReadyReplicas == want && s.Replicas == want
}

func (r *runner) webhookReady(ctx context.Context) error {
	l, err := r.tb.Client.AdmissionregistrationV1().MutatingWebhookConfigurations().List(ctx, metav1.ListOptions{
		LabelSelector: "app=sidecar-injector",
	})
	if err != nil {
		return err
	}
	if len(l.Items) == 0 {
		return errors.New("no sidecar injector webhook configuration")
	}
	for _, w := range l.Items[0].Webhooks {
		if len(w.ClientConfig.CABundle) == 0 {
			return fmt.Errorf("webhook %s has no CA bundle yet", w.Name)
		}
	}
	return nil
}

// istiodDiagnosis describes istiod's pods and the tail of their logs.
func (r *runner) istiodDiagnosis(ctx context.Context) string {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	pods, err := r.tb.Client.CoreV1().Pods(Namespace).List(ctx, metav1.ListOptions{LabelSelector: "app=istiod"})
	if err != nil {
		return "list istiod pods: " + err.Error()
	}
	var b strings.Builder
	for _, p := range pods.Items {
		fmt.Fprintf(&b, "pod %s: phase %s\n", p.Name, p.Status.Phase)
		for _, cs := range p.Status.ContainerStatuses {
			fmt.Fprintf(&b, "  %s ready=%v restarts=%d state=%+v\n", cs.Name, cs.Ready, cs.RestartCount, cs.State)
		}
		if logs, err := r.tb.PodLogs(ctx, Namespace, p.Name, "discovery"); err == nil {
			lines := strings.Split(strings.TrimSpace(logs), "\n")
			if len(lines) > 20 {
				lines = lines[len(lines)-20:]
			}
			b.WriteString("  " + strings.Join(lines, "\n  ") + "\n")
		}
	}
	return b.String()
}

// Down removes meshcni (demo.Down), then istiod and base (helm uninstall) and the
// istio-system namespace. It does nothing that is already done.
func Down(ctx context.Context, tb *testbed.Testbed, o Options) error {
	o.defaults()
	helm, err := demo.HelmPath(ctx, o.RepoRoot)
	if err != nil {
		return err
	}
	if err := demo.Down(ctx, tb, o.RepoRoot, helm, o.Timeout); err != nil {
		return fmt.Errorf("remove meshcni: %w", err)
	}
	r := &runner{o: o, tb: tb, helm: helm}
	for _, rel := range []string{IstiodRelease, BaseRelease} {
		if _, err := r.runHelm(ctx, "uninstall", rel, "--namespace", Namespace, "--ignore-not-found", "--wait"); err != nil {
			return err
		}
	}
	ctx, cancel := context.WithTimeout(ctx, o.Timeout)
	defer cancel()
	err = tb.Client.CoreV1().Namespaces().Delete(ctx, Namespace, metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete namespace %s: %w", Namespace, err)
	}
	for {
		_, err := tb.Client.CoreV1().Namespaces().Get(ctx, Namespace, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("namespace %s not gone: %w", Namespace, ctx.Err())
		case <-time.After(250 * time.Millisecond):
		}
	}
}

func (r *runner) runHelm(ctx context.Context, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, r.helm, args...)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+testbed.KubeconfigPath())
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("helm %s %s: %w: %s", args[0], args[1], err, strings.TrimSpace(string(out)))
	}
	return string(out), nil
}
