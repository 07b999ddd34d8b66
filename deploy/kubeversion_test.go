package deploy_test

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
)

// TestKubeVersions: `helm template --kube-version` on each supported Kubernetes. Where
// ValidatingAdmissionPolicy v1 is missing (before 1.30) the defaults render and the
// agent gets no pods patch, delete or eviction, and no redirected marker; from 1.30 it
// gets patch with the policy fencing it. Pod writes no policy can fence are rendered
// only when rbac.unfencedPodWrites names them; an action needing a write that is not
// granted is replaced by repair in place.
func TestKubeVersions(t *testing.T) {
	for _, tc := range []struct {
		name   string
		kube   string
		values []string
		policy bool   // the agent's ValidatingAdmissionPolicy and binding rendered
		patch  bool   // pods patch granted
		evict  bool   // pods/eviction create granted
		action string // the agent's --repair-action (its delete read as evict)
	}{
		{name: "defaults", kube: "1.27", action: "repair"},
		{name: "defaults", kube: "1.29", action: "repair"},
		{name: "defaults", kube: "1.30", policy: true, patch: true, action: "repair"},
		{name: "defaults", kube: "1.35", policy: true, patch: true, action: "repair"},
		{name: "policies-off", kube: "1.35", values: []string{"admissionPolicies.enabled=false"}, action: "repair"},
		{name: "patch-opt-in", kube: "1.29", values: []string{"rbac.unfencedPodWrites={patch}"}, patch: true, action: "repair"},
		{name: "label-not-granted", kube: "1.29", values: []string{"repair.action=label"}, action: "repair"},
		{name: "label-opt-in", kube: "1.27", values: []string{"repair.action=label", "rbac.unfencedPodWrites={patch}"}, patch: true, action: "label"},
		{name: "label-fenced", kube: "1.30", values: []string{"repair.action=label"}, policy: true, patch: true, action: "label"},
		{name: "evict-not-granted", kube: "1.35", values: []string{"repair.action=evict", "audit.escapedAction=evict"}, policy: true, patch: true, action: "repair"},
		{name: "evict-opt-in", kube: "1.35", values: []string{"repair.action=evict", "rbac.unfencedPodWrites={evict}"}, policy: true, patch: true, evict: true, action: "evict"},
		{name: "evict-opt-in", kube: "1.27", values: []string{"repair.action=evict", "rbac.unfencedPodWrites={evict}"}, evict: true, action: "evict"},
		{name: "delete-alias-opt-in", kube: "1.29", values: []string{"audit.escapedAction=delete", "rbac.unfencedPodWrites={delete,patch}"}, patch: true, evict: true, action: "repair"},
	} {
		t.Run(tc.name+"-"+tc.kube, func(t *testing.T) {
			c := load(t, append([]string{"--kube-version=" + tc.kube}, tc.values...))
			role := typed[rbacv1.ClusterRole](t, c.find("ClusterRole", "meshcni-agent"))
			wantPods := []string{"list", "watch"}
			if tc.patch {
				wantPods = []string{"list", "patch", "watch"}
			}
			if got := podVerbs(role); !slices.Equal(got, wantPods) {
				t.Errorf("agent pods verbs %v, want %v", got, wantPods)
			}
			var wantEvict []string
			if tc.evict {
				wantEvict = []string{"create"}
			}
			if got := verbsOn(role, "pods/eviction"); !slices.Equal(got, wantEvict) {
				t.Errorf("agent pods/eviction verbs %v, want %v", got, wantEvict)
			}
			for _, r := range role.Rules {
				if slices.Contains(r.Verbs, "delete") {
					t.Errorf("agent rule %+v grants delete", r)
				}
			}
			if c.agentC.MarkRedirected != tc.patch {
				t.Errorf("agent --mark-redirected %v, want %v (pods patch granted: %v)", c.agentC.MarkRedirected, tc.patch, tc.patch)
			}
			if got := actionName(string(c.agentC.RepairAction)); got != tc.action {
				t.Errorf("agent --repair-action %s, want %s", got, tc.action)
			}
			if tc.evict != (evicts(string(c.agentC.RepairAction)) || evicts(string(c.agentC.AuditEscapedAction))) {
				t.Errorf("eviction granted %v, agent actions: repair %s, escaped %s", tc.evict, c.agentC.RepairAction, c.agentC.AuditEscapedAction)
			}
			p := c.find("ValidatingAdmissionPolicy", "meshcni-agent-pods")
			if (p != nil) != tc.policy || (c.find("ValidatingAdmissionPolicyBinding", "meshcni-agent-pods") != nil) != tc.policy {
				t.Fatalf("agent policy rendered %v, want %v", p != nil, tc.policy)
			}
			if tc.kube < "1.30" && (c.count("ValidatingAdmissionPolicy") != 0 || c.count("ValidatingAdmissionPolicyBinding") != 0) {
				t.Errorf("Kubernetes %s: %d policies, %d bindings rendered; it serves none", tc.kube, c.count("ValidatingAdmissionPolicy"), c.count("ValidatingAdmissionPolicyBinding"))
			}
			if p != nil {
				// Subresources: none, or pods/eviction once granted.
				first := typed[admissionv1.ValidatingAdmissionPolicy](t, p).Spec.Validations[0].Expression
				if allows := strings.Contains(first, "'eviction'"); allows != tc.evict {
					t.Errorf("policy admits pods/eviction: %v, want %v (%s)", allows, tc.evict, first)
				}
			}
		})
	}
}

// TestNotesPodWrites: NOTES says which pod writes the agent's token has, fenced or not,
// and what an action the grants do not allow was replaced with, on Kubernetes with and
// without the policy API; it never advises turning the admission policies off.
func TestNotesPodWrites(t *testing.T) {
	for _, tc := range []struct {
		name   string
		values []string
		want   []string
	}{
		{"fenced", nil, []string{"patch: fenced by the ValidatingAdmissionPolicy meshcni-agent-pods to pods of the agent's own\n  node", "pods/eviction, delete: none."}},
		{"1.29", []string{"--kube-version=1.29"}, []string{"patch: none", "pods/eviction, delete: none.",
			"Not granted, so changed: the agent does not label redirected pods meshcni.io/redirected=true (--mark-redirected=false): it needs pods patch, and this cluster serves no ValidatingAdmissionPolicy"}},
		{"no-policy", []string{"admissionPolicies.enabled=false"}, []string{"patch: none", "pods/eviction, delete: none.",
			"Not granted, so changed: the agent does not label redirected pods meshcni.io/redirected=true (--mark-redirected=false)"}},
		{"patch-opt-in", []string{"--kube-version=1.27", "rbac.unfencedPodWrites={patch}"}, []string{"patch: UNFENCED",
			"root on any node, may patch ANY pod in the cluster: its labels, annotations, image."}},
		{"label-not-granted", []string{"admissionPolicies.enabled=false", "repair.action=label"}, []string{"Repair is on (action repair)",
			"Not granted, so changed: repair.action label needs pods patch", "set rbac.unfencedPodWrites={patch} to label"}},
		{"evict-not-granted", []string{"repair.action=evict", "audit.escapedAction=delete"}, []string{"Repair is on (action repair)",
			"Not granted, so changed: repair.action evict needs pods/eviction create", "Not granted, so changed: audit.escapedAction evict needs pods/eviction create"}},
		{"evict-opt-in", []string{"repair.action=evict", "rbac.unfencedPodWrites={evict}"}, []string{"are evicted (Eviction API",
			"pods/eviction create: UNFENCED", "root on any node, may evict ANY pod in the cluster that its PodDisruptionBudget lets go."}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			notes := renderNotes(t, tc.values)
			for _, w := range tc.want {
				if !strings.Contains(notes, w) {
					t.Errorf("NOTES lack %q:\n%s", w, notes)
				}
			}
			if strings.Contains(notes, "admissionPolicies.enabled=false") || strings.Contains(notes, "older than 1.30") {
				t.Errorf("NOTES advise turning the admission policies off:\n%s", notes)
			}
		})
	}
}

// renderNotes is NOTES.txt as `helm install` prints it, rendered without a cluster:
// `helm template` of a copy of the chart holding a ConfigMap whose data is NOTES.txt
// rendered with tpl (Helm's template command leaves NOTES out).
func renderNotes(t *testing.T, values []string) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "meshcni")
	if err := os.CopyFS(dir, os.DirFS(chartDir)); err != nil {
		t.Fatal(err)
	}
	notes, err := os.ReadFile(filepath.Join(chartDir, "templates", "NOTES.txt"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "files", "notes.txt"), notes, 0o644); err != nil {
		t.Fatal(err)
	}
	cm := "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n  notes: {{ tpl (.Files.Get \"files/notes.txt\") . | toJson }}\n"
	if err := os.WriteFile(filepath.Join(dir, "templates", "zz-notes.yaml"), []byte(cm), 0o644); err != nil {
		t.Fatal(err)
	}
	args := templateArgs(namespace, values)
	args[2] = dir
	_, objs := renderArgs(t, append(args, "--show-only", "templates/zz-notes.yaml"))
	if len(objs) != 1 {
		t.Fatalf("%d objects, want the notes ConfigMap", len(objs))
	}
	return typed[corev1.ConfigMap](t, objs[0]).Data["notes"]
}
