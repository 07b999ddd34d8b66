package deploy_test

import (
	"fmt"
	"io"
	"net"
	"os"
	"reflect"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/klog/v2"
	sigsyaml "sigs.k8s.io/yaml"

	"github.com/meshcni/meshcni/pkg/agent"
	"github.com/meshcni/meshcni/pkg/repair"
	"github.com/meshcni/meshcni/pkg/taint"
)

// chart is one rendering of the chart, with typed views of the objects tests read.
type chart struct {
	objs   []*unstructured.Unstructured
	agent  *appsv1.DaemonSet
	taint  *appsv1.Deployment // nil: taint controller off
	agentC *agent.Config      // the rendered env, parsed by the agent's own ParseFlags
	taintC *taint.Config      // same for the taint controller
	// ownNodeSelector: the values set taintController.nodeSelectorLabels.
	ownNodeSelector bool
	// ownUpdateStrategy: the values set updateStrategy.
	ownUpdateStrategy bool
}

func (c *chart) find(kind, name string) *unstructured.Unstructured {
	for _, o := range c.objs {
		if o.GetKind() == kind && o.GetName() == name {
			return o
		}
	}
	return nil
}

func (c *chart) count(kind string) int {
	n := 0
	for _, o := range c.objs {
		if o.GetKind() == kind {
			n++
		}
	}
	return n
}

// typed converts an object strictly: an unknown field is an error.
func typed[T any](t testing.TB, o *unstructured.Unstructured) *T {
	t.Helper()
	var v T
	if err := runtime.DefaultUnstructuredConverter.FromUnstructuredWithValidation(o.Object, &v, true); err != nil {
		t.Fatalf("%s %s: %v", o.GetKind(), o.GetName(), err)
	}
	return &v
}

func envOf(c corev1.Container) map[string]corev1.EnvVar {
	m := map[string]corev1.EnvVar{}
	for _, e := range c.Env {
		m[e.Name] = e
	}
	return m
}

// Stand-ins for the downward API's status.hostIP and status.podIP.
const (
	standInHostIP = "192.0.2.10"
	standInPodIP  = "198.51.100.7"
)

// envRef is a $(VAR) reference in an env value, which the kubelet expands from the
// variables defined before it.
var envRef = regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)

// getenv turns a container's env into what the process would see: downward-API values
// become plausible stand-ins, $(VAR) references to earlier variables are expanded.
func getenv(t testing.TB, c corev1.Container) func(string) string {
	t.Helper()
	m := map[string]string{}
	for _, e := range c.Env {
		switch {
		case e.ValueFrom == nil:
			m[e.Name] = envRef.ReplaceAllStringFunc(e.Value, func(ref string) string {
				v, ok := m[ref[2:len(ref)-1]]
				if !ok {
					t.Fatalf("%s=%s: $(%s) is not defined before it", e.Name, e.Value, ref[2:len(ref)-1])
				}
				return v
			})
		case e.ValueFrom.FieldRef != nil:
			m[e.Name] = map[string]string{
				"metadata.name":      "meshcni-agent-x7k2p",
				"metadata.namespace": namespace,
				"spec.nodeName":      "node-1",
				"status.hostIP":      standInHostIP,
				"status.podIP":       standInPodIP,
			}[e.ValueFrom.FieldRef.FieldPath]
			if m[e.Name] == "" {
				t.Fatalf("%s: unexpected fieldRef %s", e.Name, e.ValueFrom.FieldRef.FieldPath)
			}
		default:
			t.Fatalf("%s: unexpected valueFrom %+v", e.Name, e.ValueFrom)
		}
	}
	return func(k string) string { return m[k] }
}

// envNames are the MESHCNI_* variables a command's --help names (flagenv appends them).
func envNames(t testing.TB, help string) map[string]bool {
	t.Helper()
	names := map[string]bool{}
	for _, m := range regexp.MustCompile(`\[\$(MESHCNI_[A-Z0-9_]+)\]`).FindAllStringSubmatch(help, -1) {
		names[m[1]] = true
	}
	if len(names) < 5 {
		t.Fatalf("found only %d variables in the usage:\n%s", len(names), help)
	}
	return names
}

func agentEnvNames(t testing.TB) map[string]bool {
	var b strings.Builder
	if code := agent.Main([]string{"--help"}, func(string) string { return "" }, &b); code != 0 {
		t.Fatalf("meshcni-agent --help: exit %d", code)
	}
	return envNames(t, b.String())
}

func taintEnvNames(t testing.TB) map[string]bool {
	var b strings.Builder
	if code := taint.Main([]string{"--help"}, func(string) string { return "" }, &b); code != 0 {
		t.Fatalf("meshcni-taint-controller --help: exit %d", code)
	}
	return envNames(t, b.String())
}

// meshcniImage: a reference to a meshcni image, by tag or digest.
var meshcniImage = regexp.MustCompile(`^[^\s@]+/meshcni[-a-z0-9]*(:[A-Za-z0-9_][A-Za-z0-9_.-]*|@sha256:[0-9a-f]{64})$`)

// load renders the chart with values and checks what every rendering must hold.
func load(t *testing.T, values []string) *chart {
	t.Helper()
	_, objs := render(t, namespace, values)
	c := &chart{objs: objs}
	for _, v := range values {
		if f, ok := strings.CutPrefix(v, "@"); ok {
			b, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			c.ownNodeSelector = c.ownNodeSelector || strings.Contains(string(b), "nodeSelectorLabels:")
			c.ownUpdateStrategy = c.ownUpdateStrategy || strings.Contains(string(b), "\nupdateStrategy:")
		}
		c.ownNodeSelector = c.ownNodeSelector || strings.HasPrefix(v, "taintController.nodeSelectorLabels=")
		c.ownUpdateStrategy = c.ownUpdateStrategy || strings.HasPrefix(strings.TrimPrefix(v, "json:"), "updateStrategy")
	}
	c.checkLabels(t)
	if o := c.find("DaemonSet", "meshcni-agent"); o == nil {
		t.Fatal("no DaemonSet meshcni-agent")
	} else {
		c.agent = typed[appsv1.DaemonSet](t, o)
	}
	if o := c.find("Deployment", "meshcni-taint-controller"); o != nil {
		c.taint = typed[appsv1.Deployment](t, o)
	}
	c.checkAgent(t)
	c.checkTaint(t)
	c.checkRBAC(t)
	c.checkPolicies(t, !slices.Contains(values, "admissionPolicies.enabled=false") && policyAPI(values))
	c.checkServices(t)
	return c
}

// policyAPI: does the rendering's Kubernetes (--kube-version, else Helm's default, newer
// than 1.30) serve ValidatingAdmissionPolicy v1, i.e. is it 1.30 or newer?
func policyAPI(values []string) bool {
	for _, v := range values {
		if kv, ok := strings.CutPrefix(v, "--kube-version="); ok {
			minor, err := strconv.Atoi(strings.Split(strings.TrimPrefix(strings.TrimPrefix(kv, "v"), "1."), ".")[0])
			return err == nil && minor >= 30
		}
	}
	return true
}

var recommended = []string{
	"app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
	"app.kubernetes.io/component", "app.kubernetes.io/part-of", "app.kubernetes.io/managed-by",
}

func (c *chart) checkLabels(t *testing.T) {
	t.Helper()
	for _, o := range c.objs {
		l := o.GetLabels()
		for _, k := range recommended {
			if l[k] == "" {
				t.Errorf("%s %s: no label %s", o.GetKind(), o.GetName(), k)
			}
		}
		if l["app.kubernetes.io/name"] != "meshcni" || l["app.kubernetes.io/instance"] != release || l["app.kubernetes.io/part-of"] != "meshcni" {
			t.Errorf("%s %s: labels %v", o.GetKind(), o.GetName(), l)
		}
		switch o.GetKind() {
		case "NetworkAttachmentDefinition":
			// Where Istio's injector asks for it: k8s.v1.cni.cncf.io/networks: default/istio-cni.
			if o.GetNamespace() != "default" {
				t.Errorf("%s %s: namespace %q, want default", o.GetKind(), o.GetName(), o.GetNamespace())
			}
		case "ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding":
			if o.GetNamespace() != "" {
				t.Errorf("%s %s: cluster-scoped object with namespace %q", o.GetKind(), o.GetName(), o.GetNamespace())
			}
		default:
			if o.GetNamespace() != namespace {
				t.Errorf("%s %s: namespace %q, want the release's %q", o.GetKind(), o.GetName(), o.GetNamespace(), namespace)
			}
		}
	}
}

func (c *chart) checkAgent(t *testing.T) {
	t.Helper()
	ds := c.agent
	ps := ds.Spec.Template.Spec
	sel, err := labels.ValidatedSelectorFromSet(ds.Spec.Selector.MatchLabels)
	if err != nil {
		t.Fatal(err)
	}
	pl := labels.Set(ds.Spec.Template.Labels)
	if !sel.Matches(pl) || pl["app.kubernetes.io/name"] != "meshcni" || pl["app.kubernetes.io/component"] != "agent" {
		t.Errorf("agent pod labels %v (selector %v)", pl, sel)
	}
	if !ps.HostNetwork || ps.DNSPolicy != corev1.DNSClusterFirstWithHostNet {
		t.Errorf("agent: hostNetwork %v, dnsPolicy %q", ps.HostNetwork, ps.DNSPolicy)
	}
	if u := ds.Spec.UpdateStrategy; !c.ownUpdateStrategy && (u.Type != appsv1.RollingUpdateDaemonSetStrategyType || u.RollingUpdate == nil || u.RollingUpdate.MaxUnavailable.IntValue() != 1) {
		t.Errorf("agent update strategy %+v", u)
	}
	if len(ps.Containers) != 1 {
		t.Fatalf("agent: %d containers", len(ps.Containers))
	}
	ct := ps.Containers[0]
	if !meshcniImage.MatchString(ct.Image) {
		t.Errorf("agent image %q: want <hub>/meshcni:<tag> or a meshcni reference with a tag or digest", ct.Image)
	}
	if !slices.Equal(ct.Command, []string{"/usr/local/bin/meshcni-agent"}) {
		t.Errorf("agent command %q", ct.Command)
	}
	// Every variable is one the agent reads, and the agent's own parser accepts them all.
	known := agentEnvNames(t)
	for _, e := range ct.Env {
		if strings.HasPrefix(e.Name, "MESHCNI_") && !known[e.Name] {
			t.Errorf("agent env %s: meshcni-agent has no such flag", e.Name)
		}
	}
	cfg, err := agent.ParseFlags(ct.Args, getenv(t, ct), io.Discard)
	if err != nil {
		t.Fatalf("the agent rejects the rendered env: %v", err)
	}
	c.agentC = cfg
	if cfg.PodName == "" || cfg.PodNamespace != namespace || cfg.NodeName == "" {
		t.Errorf("agent downward API: pod %q/%q node %q", cfg.PodNamespace, cfg.PodName, cfg.NodeName)
	}
	// Probes on the health address: the agent is host-network, so kubelet probes the
	// node's IP unless the probe names the host the server listens on.
	host, port, err := net.SplitHostPort(cfg.HealthAddr)
	if err != nil {
		t.Fatalf("agent health addr %q: %v", cfg.HealthAddr, err)
	}
	if len(ct.Ports) != 1 || fmt.Sprint(ct.Ports[0].ContainerPort) != port || ct.Ports[0].Name != "metrics" {
		t.Errorf("agent ports %+v, health addr %q", ct.Ports, cfg.HealthAddr)
	}
	for _, p := range []struct {
		probe *corev1.Probe
		path  string
	}{{ct.ReadinessProbe, "/readyz"}, {ct.LivenessProbe, "/healthz"}} {
		if p.probe == nil || p.probe.HTTPGet == nil || p.probe.HTTPGet.Path != p.path || p.probe.HTTPGet.Port.String() != "metrics" {
			t.Errorf("agent probe for %s: %+v", p.path, p.probe)
			continue
		}
		probed := p.probe.HTTPGet.Host
		if probed == "" {
			probed = standInHostIP // a host-network pod's IP is the node's
		}
		if ip := net.ParseIP(host); host != probed && host != "" && !(ip != nil && ip.IsUnspecified()) {
			t.Errorf("agent probe for %s asks %s, the server listens on %s", p.path, probed, host)
		}
	}
	// Seccomp: the runtime's default profile for the whole pod.
	if sc := ps.SecurityContext; sc == nil || sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("agent pod seccomp profile: %+v, want RuntimeDefault", sc)
	}
	// SYS_PTRACE only where it is used: finding pods' netns through the host's /proc.
	if sc := ct.SecurityContext; sc != nil && sc.Capabilities != nil {
		ptrace := slices.Contains(sc.Capabilities.Add, corev1.Capability("SYS_PTRACE"))
		entersNetns := (cfg.Repair && cfg.RepairAction == repair.ActionRepair) || cfg.AuditPeriod > 0
		if usesProc := ps.HostPID && entersNetns; ptrace != usesProc {
			t.Errorf("agent SYS_PTRACE %v, hostPID %v, repair %v %s, audit period %s: want SYS_PTRACE exactly where repair in place or the audit finds netns through the host's /proc",
				ptrace, ps.HostPID, cfg.Repair, cfg.RepairAction, cfg.AuditPeriod)
		}
	}
	// keepOnUpgrade auto: the agent names its DaemonSet, and may read it (and nothing more).
	c.checkExitRBAC(t, cfg)
	// The node's directories are mounted at the same paths: the plugin entry names them.
	vols := map[string]corev1.Volume{}
	for _, v := range ps.Volumes {
		vols[v.Name] = v
	}
	mounted := map[string]bool{}
	for _, m := range ct.VolumeMounts {
		v, ok := vols[m.Name]
		if !ok {
			t.Errorf("agent mount %s: no volume", m.Name)
			continue
		}
		if v.HostPath == nil || v.HostPath.Path != m.MountPath {
			t.Errorf("agent mount %s at %s: volume %+v", m.Name, m.MountPath, v.VolumeSource)
		}
		mounted[m.MountPath] = true
	}
	for _, d := range []string{cfg.CNIBinDir, cfg.CNIConfDir, cfg.RunDir} {
		if !mounted[d] {
			t.Errorf("agent: %s is not mounted from the node", d)
		}
	}
	if cfg.Repair && cfg.RepairAction == repair.ActionRepair {
		for _, d := range cfg.RepairNetnsDirs {
			if !mounted[d] {
				t.Errorf("agent: repair netns dir %s is not mounted from the node", d)
			}
		}
	}
	for _, m := range ct.VolumeMounts {
		if m.MountPropagation != nil && *m.MountPropagation != corev1.MountPropagationHostToContainer {
			t.Errorf("agent mount %s: propagation %s", m.Name, *m.MountPropagation)
		}
	}
}

// checkExitRBAC: with --keep-on-exit auto the agent reads exactly its own DaemonSet,
// through a Role in the release namespace that grants get on that name only.
func (c *chart) checkExitRBAC(t *testing.T, cfg *agent.Config) {
	t.Helper()
	role := c.find("Role", c.agent.Name)
	if cfg.KeepOnExit != agent.KeepAuto {
		if role != nil || cfg.DaemonSetName != "" {
			t.Errorf("--keep-on-exit %s with a DaemonSet name %q and Role %v", cfg.KeepOnExit, cfg.DaemonSetName, role != nil)
		}
		return
	}
	if cfg.DaemonSetName != c.agent.Name || cfg.PodNamespace != c.agent.Namespace {
		t.Errorf("--daemonset-name %q in %q, the agent's DaemonSet is %s/%s", cfg.DaemonSetName, cfg.PodNamespace, c.agent.Namespace, c.agent.Name)
	}
	if role == nil {
		t.Fatalf("no Role %s for --keep-on-exit auto", c.agent.Name)
	}
	want := []rbacv1.PolicyRule{{APIGroups: []string{"apps"}, Resources: []string{"daemonsets"}, ResourceNames: []string{c.agent.Name}, Verbs: []string{"get"}}}
	if r := typed[rbacv1.Role](t, role); !reflect.DeepEqual(r.Rules, want) {
		t.Errorf("Role %s rules %+v, want %+v", c.agent.Name, r.Rules, want)
	}
	rb := c.find("RoleBinding", c.agent.Name)
	if rb == nil {
		t.Fatalf("no RoleBinding %s", c.agent.Name)
	}
	b := typed[rbacv1.RoleBinding](t, rb)
	if b.RoleRef.Kind != "Role" || b.RoleRef.Name != c.agent.Name || len(b.Subjects) != 1 || b.Subjects[0].Name != c.agent.Spec.Template.Spec.ServiceAccountName {
		t.Errorf("RoleBinding %s: %+v", c.agent.Name, b)
	}
}

func (c *chart) checkTaint(t *testing.T) {
	t.Helper()
	if c.taint == nil {
		return
	}
	ps := c.taint.Spec.Template.Spec
	if len(ps.Containers) != 1 {
		t.Fatalf("taint controller: %d containers", len(ps.Containers))
	}
	ct := ps.Containers[0]
	if !slices.Equal(ct.Command, []string{"/usr/local/bin/meshcni-taint-controller"}) {
		t.Errorf("taint controller command %q", ct.Command)
	}
	if ct.Image != c.agent.Spec.Template.Spec.Containers[0].Image {
		t.Errorf("taint controller image %q, agent's %q", ct.Image, c.agent.Spec.Template.Spec.Containers[0].Image)
	}
	known := taintEnvNames(t)
	for _, e := range ct.Env {
		if e.Name != "POD_NAMESPACE" && e.Name != "POD_IP" && !known[e.Name] && e.Name != "KUBERNETES_SERVICE_HOST" && e.Name != "KUBERNETES_SERVICE_PORT" {
			t.Errorf("taint controller env %s: meshcni-taint-controller has no such flag", e.Name)
		}
	}
	cfg, err := taint.ParseFlags(ct.Args, getenv(t, ct), io.Discard)
	if err != nil {
		t.Fatalf("the taint controller rejects the rendered env: %v", err)
	}
	c.taintC = cfg
	// It watches exactly this release's agent pods.
	if cfg.AgentNamespace != namespace || !cfg.AgentSelector.Matches(labels.Set(c.agent.Spec.Template.Labels)) {
		t.Errorf("taint controller watches %s/%v; agent pods are %s/%v", cfg.AgentNamespace, cfg.AgentSelector, namespace, c.agent.Spec.Template.Labels)
	}
	other := labels.Set(maps(c.agent.Spec.Template.Labels, "app.kubernetes.io/instance", "other"))
	if cfg.AgentSelector.Matches(other) {
		t.Errorf("taint controller selector %v also matches another release's agents", cfg.AgentSelector)
	}
	if *c.taint.Spec.Replicas > 1 && !cfg.LeaderElect {
		t.Errorf("%d replicas without leader election", *c.taint.Spec.Replicas)
	}
	if cfg.LeaderElect && cfg.LeaseNamespace != namespace {
		t.Errorf("lease namespace %q", cfg.LeaseNamespace)
	}
	// Without its own node selector it never manages a node the agent is not scheduled
	// on (a node lacking one of the agent's nodeSelector labels, e.g. a Windows node):
	// such a node would stay tainted for ever.
	if ns := c.agent.Spec.Template.Spec.NodeSelector; !c.ownNodeSelector {
		if !cfg.NodeSelector.Matches(labels.Set(ns)) {
			t.Errorf("taint controller node selector %q leaves out the agent's nodes %v", cfg.NodeSelector, ns)
		}
		for k := range ns {
			if other := labels.Set(maps(ns, k, "other")); cfg.NodeSelector.Matches(other) {
				t.Errorf("taint controller node selector %q manages node %v, where the agent (nodeSelector %v) never runs", cfg.NodeSelector, other, ns)
			}
		}
	}
	if !tolerates(ps.Tolerations, corev1.Taint{Key: taint.TaintKey, Effect: taint.TaintEffect}) {
		t.Errorf("taint controller does not tolerate its own taint: %+v", ps.Tolerations)
	}
	host, port, err := net.SplitHostPort(cfg.HealthAddr)
	if err != nil || host != standInPodIP {
		t.Errorf("taint controller health addr %q: %v, want the pod's IP %s (kubelet probes it there)", cfg.HealthAddr, err, standInPodIP)
	}
	if len(ct.Ports) != 1 || fmt.Sprint(ct.Ports[0].ContainerPort) != port {
		t.Errorf("taint controller ports %+v, health addr %q", ct.Ports, cfg.HealthAddr)
	}
	if sc := ps.SecurityContext; sc == nil || sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("taint controller pod seccomp profile: %+v, want RuntimeDefault", sc)
	}
	if ct.ReadinessProbe == nil || ct.ReadinessProbe.HTTPGet.Path != "/readyz" || ct.LivenessProbe == nil || ct.LivenessProbe.HTTPGet.Path != "/healthz" {
		t.Errorf("taint controller probes %+v %+v", ct.ReadinessProbe, ct.LivenessProbe)
	}
}

func maps(m map[string]string, k, v string) map[string]string {
	out := map[string]string{}
	for a, b := range m {
		out[a] = b
	}
	out[k] = v
	return out
}

func tolerates(ts []corev1.Toleration, taint corev1.Taint) bool {
	for _, tol := range ts {
		if tol.ToleratesTaint(klog.Background(), &taint, false) {
			return true
		}
	}
	return false
}

// evicts: an agent action value that evicts (evict, or its other name delete).
func evicts(a string) bool { return a == "evict" || a == "delete" }

// actionName is an agent action's name, delete read as evict.
func actionName(a string) string {
	if evicts(a) {
		return "evict"
	}
	return a
}

// podVerbs are the verbs a ClusterRole grants on pods.
func podVerbs(cr *rbacv1.ClusterRole) []string { return verbsOn(cr, "pods") }

// verbsOn are the verbs a ClusterRole grants on a core resource (or subresource).
func verbsOn(cr *rbacv1.ClusterRole, resource string) []string {
	var v []string
	for _, r := range cr.Rules {
		if slices.Contains(r.APIGroups, "") && slices.Contains(r.Resources, resource) {
			v = append(v, r.Verbs...)
		}
	}
	sort.Strings(v)
	return v
}

func (c *chart) checkRBAC(t *testing.T) {
	t.Helper()
	sas := map[string]bool{}
	for _, o := range c.objs {
		if o.GetKind() == "ServiceAccount" {
			sas[o.GetName()] = true
		}
	}
	if sa := c.agent.Spec.Template.Spec.ServiceAccountName; !sas[sa] {
		t.Errorf("agent service account %q is not rendered", sa)
	}
	if c.taint != nil {
		if sa := c.taint.Spec.Template.Spec.ServiceAccountName; !sas[sa] || sa == c.agent.Spec.Template.Spec.ServiceAccountName {
			t.Errorf("taint controller service account %q (rendered: %v)", sa, sas)
		}
	}
	for _, o := range c.objs {
		var subjects []rbacv1.Subject
		var ref rbacv1.RoleRef
		switch o.GetKind() {
		case "ClusterRoleBinding":
			b := typed[rbacv1.ClusterRoleBinding](t, o)
			subjects, ref = b.Subjects, b.RoleRef
		case "RoleBinding":
			b := typed[rbacv1.RoleBinding](t, o)
			subjects, ref = b.Subjects, b.RoleRef
		default:
			continue
		}
		if c.find(ref.Kind, ref.Name) == nil {
			t.Errorf("%s %s: role %s %s is not rendered", o.GetKind(), o.GetName(), ref.Kind, ref.Name)
		}
		for _, s := range subjects {
			if s.Kind != "ServiceAccount" || !sas[s.Name] || s.Namespace != namespace {
				t.Errorf("%s %s: subject %+v", o.GetKind(), o.GetName(), s)
			}
		}
	}
	// The agent's pod verbs follow the repair action and the redirected marker: nothing
	// beyond what it does.
	cr := c.find("ClusterRole", "meshcni-agent")
	if cr == nil {
		t.Fatal("no ClusterRole meshcni-agent")
	}
	// Never pods delete: an evict action goes through pods/eviction (the agent's
	// "delete" is its name for evict).
	want := []string{"list", "watch"}
	if c.agentC.MarkRedirected || c.agentC.Repair && c.agentC.RepairAction == repair.ActionLabel {
		want = append(want, "patch")
	}
	sort.Strings(want)
	agentRole := typed[rbacv1.ClusterRole](t, cr)
	if got := podVerbs(agentRole); !slices.Equal(got, want) {
		t.Errorf("agent pod verbs %v, want %v (repair %v, action %s; mark redirected %v)", got, want,
			c.agentC.Repair, c.agentC.RepairAction, c.agentC.MarkRedirected)
	}
	var wantEvict []string
	if c.agentC.Repair && evicts(string(c.agentC.RepairAction)) ||
		c.agentC.AuditPeriod > 0 && evicts(string(c.agentC.AuditEscapedAction)) {
		wantEvict = []string{"create"}
	}
	if got := verbsOn(agentRole, "pods/eviction"); !slices.Equal(got, wantEvict) {
		t.Errorf("agent pods/eviction verbs %v, want %v (repair %v, action %s; audit period %s, escaped action %s)", got, wantEvict,
			c.agentC.Repair, c.agentC.RepairAction, c.agentC.AuditPeriod, c.agentC.AuditEscapedAction)
	}
	c.checkPluginRBAC(t)
	for _, o := range c.objs {
		if o.GetKind() != "ClusterRole" && o.GetKind() != "Role" {
			continue
		}
		for _, r := range typed[rbacv1.ClusterRole](t, o).Rules {
			for _, s := range append(append([]string{}, r.Verbs...), append(r.Resources, r.APIGroups...)...) {
				if s == "*" {
					t.Errorf("%s %s: wildcard in %+v", o.GetKind(), o.GetName(), r)
				}
			}
		}
	}
}

// checkPluginRBAC: the plugin's ServiceAccount, the one the agent is told to mint for,
// may get pods and nothing else; the agent may mint tokens of that ServiceAccount only.
func (c *chart) checkPluginRBAC(t *testing.T) {
	t.Helper()
	name := c.agentC.PluginServiceAccount
	sa := c.find("ServiceAccount", name)
	if name != "meshcni-plugin" || sa == nil {
		t.Fatalf("agent --plugin-service-account %q: rendered %v", name, sa != nil)
	}
	if am := typed[corev1.ServiceAccount](t, sa).AutomountServiceAccountToken; am == nil || *am {
		t.Errorf("plugin ServiceAccount automounts its token: %v", am)
	}
	cr := c.find("ClusterRole", name)
	if cr == nil {
		t.Fatalf("no ClusterRole %s", name)
	}
	want := []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get"}}}
	if got := typed[rbacv1.ClusterRole](t, cr).Rules; !reflect.DeepEqual(got, want) {
		t.Errorf("plugin rules %+v, want get pods only", got)
	}
	b := c.find("ClusterRoleBinding", name)
	if b == nil {
		t.Fatalf("no ClusterRoleBinding %s", name)
	}
	if crb := typed[rbacv1.ClusterRoleBinding](t, b); crb.RoleRef.Name != name || len(crb.Subjects) != 1 || crb.Subjects[0].Name != name {
		t.Errorf("plugin binding %+v", crb)
	}
	// Every grant of serviceaccounts/token in the chart: the agent's, for the plugin only.
	agentSA := c.agent.Spec.Template.Spec.ServiceAccountName
	n := 0
	for _, o := range c.objs {
		if o.GetKind() != "Role" && o.GetKind() != "ClusterRole" {
			continue
		}
		for _, r := range typed[rbacv1.ClusterRole](t, o).Rules {
			if !slices.Contains(r.Resources, "serviceaccounts/token") {
				continue
			}
			n++
			if o.GetKind() != "Role" || o.GetName() != agentSA+"-plugin-token" || !slices.Equal(r.ResourceNames, []string{name}) || !slices.Equal(r.Verbs, []string{"create"}) {
				t.Errorf("%s %s grants %+v; want the agent's Role to create tokens of %s only", o.GetKind(), o.GetName(), r, name)
			}
		}
	}
	if n != 1 {
		t.Errorf("%d grants of serviceaccounts/token, want the agent's one", n)
	}
	if rb := c.find("RoleBinding", agentSA+"-plugin-token"); rb == nil || typed[rbacv1.RoleBinding](t, rb).Subjects[0].Name != agentSA {
		t.Errorf("agent RoleBinding %s", yamlOf(t, rb))
	}
}

// checkPolicies: each ValidatingAdmissionPolicy has its binding (Deny) and matches the
// rendered ServiceAccount it fences, by user name; with admission policies off, none.
func (c *chart) checkPolicies(t *testing.T, enabled bool) {
	t.Helper()
	want := map[string]string{}
	if enabled {
		want["meshcni-agent-pods"] = "system:serviceaccount:" + namespace + ":" + c.agent.Spec.Template.Spec.ServiceAccountName
		if c.taint != nil {
			want["meshcni-taint-controller-nodes"] = "system:serviceaccount:" + namespace + ":" + c.taint.Spec.Template.Spec.ServiceAccountName
		}
	}
	if n := c.count("ValidatingAdmissionPolicy"); n != len(want) || c.count("ValidatingAdmissionPolicyBinding") != len(want) {
		t.Errorf("%d policies, %d bindings; want %d", n, c.count("ValidatingAdmissionPolicyBinding"), len(want))
	}
	for name, user := range want {
		p := c.find("ValidatingAdmissionPolicy", name)
		b := c.find("ValidatingAdmissionPolicyBinding", name)
		if p == nil || b == nil {
			t.Errorf("policy %s: %v, binding: %v", name, p != nil, b != nil)
			continue
		}
		vap := typed[admissionv1.ValidatingAdmissionPolicy](t, p)
		if vap.Spec.FailurePolicy == nil || *vap.Spec.FailurePolicy != admissionv1.Fail || len(vap.Spec.MatchConditions) != 1 ||
			vap.Spec.MatchConditions[0].Expression != fmt.Sprintf("request.userInfo.username == %q", user) {
			t.Errorf("policy %s: failurePolicy %v, matchConditions %+v; want Fail for user %s", name, vap.Spec.FailurePolicy, vap.Spec.MatchConditions, user)
		}
		vb := typed[admissionv1.ValidatingAdmissionPolicyBinding](t, b)
		if vb.Spec.PolicyName != name || !slices.Equal(vb.Spec.ValidationActions, []admissionv1.ValidationAction{admissionv1.Deny}) {
			t.Errorf("binding %s: %+v", name, vb.Spec)
		}
	}
}

func (c *chart) checkServices(t *testing.T) {
	t.Helper()
	for _, o := range c.objs {
		if o.GetKind() != "Service" {
			continue
		}
		svc := typed[corev1.Service](t, o)
		var pods map[string]string
		switch svc.Labels["app.kubernetes.io/component"] {
		case "agent":
			pods = c.agent.Spec.Template.Labels
		case "taint-controller":
			if c.taint == nil {
				t.Fatalf("Service %s without the taint controller", svc.Name)
			}
			pods = c.taint.Spec.Template.Labels
		default:
			t.Fatalf("Service %s: component %q", svc.Name, svc.Labels["app.kubernetes.io/component"])
		}
		if !labels.SelectorFromSet(svc.Spec.Selector).Matches(labels.Set(pods)) || len(svc.Spec.Selector) == 0 {
			t.Errorf("Service %s selects %v, not the pods %v", svc.Name, svc.Spec.Selector, pods)
		}
		if svc.Spec.ClusterIP != corev1.ClusterIPNone || len(svc.Spec.Ports) != 1 || svc.Spec.Ports[0].Name != "metrics" {
			t.Errorf("Service %s: %+v", svc.Name, svc.Spec)
		}
	}
}

func yamlOf(t testing.TB, o *unstructured.Unstructured) string {
	t.Helper()
	if o == nil {
		return ""
	}
	b, err := sigsyaml.Marshal(o.Object)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
