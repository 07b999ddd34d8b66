package deploy_test

import (
	"fmt"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"

	"github.com/meshcni/meshcni/pkg/repair"
)

const testDigest = "sha256:4f3c1d2e5a6b7c8d9e0f1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1c2d"

type mappedCase struct {
	values []string
	check  func(t *testing.T, c *chart) error
}

func agentSpec(c *chart) corev1.PodSpec { return c.agent.Spec.Template.Spec }
func agentCt(c *chart) corev1.Container { return c.agent.Spec.Template.Spec.Containers[0] }
func taintCt(c *chart) corev1.Container { return c.taint.Spec.Template.Spec.Containers[0] }
func errorf(f string, a ...any) error   { return fmt.Errorf(f, a...) }
func agentImage(c *chart) string        { return agentCt(c).Image }
func expect(ok bool, f string, a ...any) error {
	if ok {
		return nil
	}
	return fmt.Errorf(f, a...)
}

// mappedCases: for every Istio value the table maps, values that set it and what the
// rendered chart must then show (written from Istio's chart's meaning of the value).
func mappedCases() map[string][]mappedCase {
	img := func(want string) func(*testing.T, *chart) error {
		return func(_ *testing.T, c *chart) error {
			return expect(agentImage(c) == want && taintCt(c).Image == want, "agent image %q, taint controller %q, want %q", agentImage(c), taintCt(c).Image, want)
		}
	}
	pull := func(want corev1.PullPolicy) func(*testing.T, *chart) error {
		return func(_ *testing.T, c *chart) error {
			return expect(agentCt(c).ImagePullPolicy == want && taintCt(c).ImagePullPolicy == want, "pull policy %q/%q, want %q", agentCt(c).ImagePullPolicy, taintCt(c).ImagePullPolicy, want)
		}
	}
	level := func(want string) func(*testing.T, *chart) error {
		return func(_ *testing.T, c *chart) error {
			return expect(c.agentC.LogLevel.String() == want && c.taintC.LogLevel.String() == want, "log level %s/%s, want %s", c.agentC.LogLevel, c.taintC.LogLevel, want)
		}
	}
	action := func(enabled bool, want repair.Action) func(*testing.T, *chart) error {
		return func(_ *testing.T, c *chart) error {
			got := actionName(string(c.agentC.RepairAction))
			return expect(c.agentC.Repair == enabled && (!enabled || got == string(want)), "repair %v %s, want %v %s", c.agentC.Repair, got, enabled, want)
		}
	}
	return map[string][]mappedCase{
		"hub":     {{[]string{"hub=registry.example.com/mesh"}, img("registry.example.com/mesh/meshcni:0.1.0")}},
		"tag":     {{[]string{"tag=1.2.3"}, img("ghcr.io/meshcni/meshcni:1.2.3")}},
		"variant": nil, // refused but for "" and distroless, which change nothing
		"image": {
			{[]string{"image=registry.example.com/mesh/meshcni@" + testDigest}, img("registry.example.com/mesh/meshcni@" + testDigest)},
			{[]string{"image=registry.example.com/mesh/meshcni:1.2.3", "hub=other.example.com", "tag=v9"}, img("registry.example.com/mesh/meshcni:1.2.3")},
			{[]string{"image=install-cni", "tag=1.2.3"}, img("ghcr.io/meshcni/meshcni:1.2.3")},
			{[]string{"image=meshcni-debug", "hub=registry.example.com/mesh"}, img("registry.example.com/mesh/meshcni-debug:0.1.0")},
			{[]string{"image=meshcni@" + testDigest}, img("ghcr.io/meshcni/meshcni@" + testDigest)},
		},
		"pullPolicy": {
			{[]string{"pullPolicy="}, pull("")},
			{[]string{"pullPolicy=", "global.imagePullPolicy=Always"}, pull(corev1.PullAlways)},
		},
		"global.hub": {
			{[]string{"global.hub=registry.example.com/istio"}, img("registry.example.com/istio/meshcni:0.1.0")},
			{[]string{"hub=", "global.hub=registry.example.com/istio"}, img("registry.example.com/istio/meshcni:0.1.0")},
			{[]string{"hub=own.example.com/mesh", "global.hub=registry.example.com/istio"}, img("own.example.com/mesh/meshcni:0.1.0")},
		},
		"global.tag": {
			{[]string{"global.tag=1.28.0"}, img("ghcr.io/meshcni/meshcni:1.28.0")},
			{[]string{"tag=2.0.0", "global.tag=1.28.0"}, img("ghcr.io/meshcni/meshcni:2.0.0")},
		},
		"global.imagePullPolicy": {
			{[]string{"global.imagePullPolicy=Never"}, pull(corev1.PullNever)},
			{[]string{"pullPolicy=Always", "global.imagePullPolicy=Never"}, pull(corev1.PullAlways)},
		},
		"global.imagePullSecrets": {{[]string{"global.imagePullSecrets={corp,mirror}", "imagePullSecrets[0].name=corp"}, func(_ *testing.T, c *chart) error {
			want := []corev1.LocalObjectReference{{Name: "corp"}, {Name: "mirror"}}
			return expect(reflect.DeepEqual(agentSpec(c).ImagePullSecrets, want) && reflect.DeepEqual(c.taint.Spec.Template.Spec.ImagePullSecrets, want),
				"pull secrets %v / %v, want %v", agentSpec(c).ImagePullSecrets, c.taint.Spec.Template.Spec.ImagePullSecrets, want)
		}}},
		"logging.level": {
			{[]string{"logging.level=debug", "global.logging.level=error"}, level("DEBUG")},
			{[]string{`logging.level=cni:debug\,default:warn`}, level("WARN")},
		},
		"global.logging.level": {{[]string{"global.logging.level=error", "logLevel=debug"}, level("ERROR")}},
		"cniBinDir": {
			{[]string{"cniBinDir=/var/lib/cni/bin"}, func(_ *testing.T, c *chart) error {
				return expect(c.agentC.CNIBinDir == "/var/lib/cni/bin", "bin dir %q", c.agentC.CNIBinDir)
			}},
			// Empty: /opt/cni/bin, or /home/kubernetes/bin when the API server's version holds
			// "-gke" (Istio's detection); helm template --kube-version drops that suffix, so
			// only the first half is shown here.
			{[]string{"cniBinDir=", "--kube-version=v1.31.5"}, func(_ *testing.T, c *chart) error {
				return expect(c.agentC.CNIBinDir == "/opt/cni/bin", "bin dir %q, want /opt/cni/bin", c.agentC.CNIBinDir)
			}},
		},
		"cniConfDir": {{[]string{"cniConfDir=/var/snap/microk8s/current/args/cni-network"}, func(_ *testing.T, c *chart) error {
			return expect(c.agentC.CNIConfDir == "/var/snap/microk8s/current/args/cni-network" && mountPaths(c)[c.agentC.CNIConfDir], "conf dir %q", c.agentC.CNIConfDir)
		}}},
		"cniConfFileName": {{[]string{"cniConfFileName=10-calico.conflist"}, func(_ *testing.T, c *chart) error {
			return expect(c.agentC.CNIConfFileName == "10-calico.conflist", "conf file %q", c.agentC.CNIConfFileName)
		}}},
		"chained": {{[]string{"chained=false"}, func(_ *testing.T, c *chart) error {
			return expect(!c.agentC.Chained && c.agentC.NetworkName == "meshcni" && c.count("NetworkAttachmentDefinition") == 0, "chained %v, network %q", c.agentC.Chained, c.agentC.NetworkName)
		}}},
		"provider": {
			{[]string{"provider=multus", "chained=false"}, checkMultus},
			{[]string{"provider=default", "chained=false"}, func(_ *testing.T, c *chart) error {
				return expect(c.agentC.NetworkName == "meshcni" && c.count("NetworkAttachmentDefinition") == 0, "network %q, %d NADs", c.agentC.NetworkName, c.count("NetworkAttachmentDefinition"))
			}},
		},
		"cniNetnsDir": {{[]string{"cniNetnsDir=/var/run/docker/netns"}, func(_ *testing.T, c *chart) error {
			d := c.agentC.RepairNetnsDirs
			return expect(len(d) == 3 && d[0] == "/var/run/docker/netns" && mountPaths(c)["/var/run/docker/netns"], "netns dirs %v", d)
		}}},
		"excludeNamespaces": {{[]string{"excludeNamespaces={kube-system,istio-system}"}, func(_ *testing.T, c *chart) error {
			return expect(strings.Join(c.agentC.ExcludeNamespaces, ",") == "kube-system,istio-system" && slices.Equal(c.agentC.Entry().ExcludeNamespaces, c.agentC.ExcludeNamespaces), "exclude %v", c.agentC.ExcludeNamespaces)
		}}},
		"global.nativeNftables": {
			{[]string{"global.nativeNftables=true"}, func(_ *testing.T, c *chart) error {
				return expect(c.agentC.Backend == "nftables", "backend %q", c.agentC.Backend)
			}},
			{[]string{"global.nativeNftables=false", "backend=iptables-legacy"}, func(_ *testing.T, c *chart) error {
				return expect(c.agentC.Backend == "iptables-legacy", "backend %q", c.agentC.Backend)
			}},
		},
		"repair.enabled":    {{[]string{"repair.enabled=false"}, action(false, "")}},
		"repair.repairPods": {{[]string{"repair.action=delete", "repair.repairPods=true", "repair.deletePods=true"}, action(true, repair.ActionRepair)}, {[]string{"repair.repairPods=false"}, action(false, "")}},
		"repair.deletePods": {
			// evict (the agent's delete), once granted by name; else repaired in place.
			{[]string{"repair.repairPods=false", "repair.deletePods=true", "repair.labelPods=true", "rbac.unfencedPodWrites={evict}"}, action(true, "evict")},
			{[]string{"repair.repairPods=false", "repair.deletePods=true"}, action(true, repair.ActionRepair)},
		},
		"repair.labelPods": {{[]string{"repair.repairPods=false", "repair.labelPods=true"}, action(true, repair.ActionLabel)}},
		"repair.initContainerName": {{[]string{"repair.initContainerName=mesh-check"}, func(_ *testing.T, c *chart) error {
			return expect(c.agentC.RepairInitContainer == "mesh-check", "init container %q", c.agentC.RepairInitContainer)
		}}},
		"repair.brokenPodLabelKey": {{[]string{"repair.repairPods=false", "repair.labelPods=true", "repair.brokenPodLabelKey=example.com/broken"}, func(_ *testing.T, c *chart) error {
			return expect(c.agentC.RepairAction == repair.ActionLabel && c.agentC.RepairLabelKey == "example.com/broken", "repair %s label %q", c.agentC.RepairAction, c.agentC.RepairLabelKey)
		}}},
		"repair.initContainerTerminationMsg": {{[]string{"repair.initContainerTerminationMsg=no redirect (exit 126)"}, func(_ *testing.T, c *chart) error {
			re, err := regexp.Compile(c.agentC.RepairMessage)
			if err != nil {
				return err
			}
			// Istio matches a substring: the text inside a longer message, and not another text.
			return expect(re.MatchString("iptables check: no redirect (exit 126) for 10.0.0.1") && !re.MatchString("no redirect exit 126"), "message %q", c.agentC.RepairMessage)
		}}},
		"repair.initContainerExitCode": {{[]string{"repair.initContainerExitCode=42"}, func(_ *testing.T, c *chart) error {
			return expect(c.agentC.RepairExitCode == 42, "exit code %d", c.agentC.RepairExitCode)
		}}},
		"affinity": {{[]string{`json:affinity={"nodeAffinity":{"requiredDuringSchedulingIgnoredDuringExecution":{"nodeSelectorTerms":[{"matchExpressions":[{"key":"pool","operator":"NotIn","values":["gpu"]}]}]}}}`}, func(_ *testing.T, c *chart) error {
			a := agentSpec(c).Affinity
			return expect(a != nil && a.NodeAffinity != nil && a.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms[0].MatchExpressions[0].Values[0] == "gpu", "affinity %+v", a)
		}}},
		"daemonSetLabels": {{[]string{"daemonSetLabels.team=mesh"}, func(_ *testing.T, c *chart) error {
			return expect(c.agent.Labels["team"] == "mesh" && c.agent.Spec.Template.Labels["team"] == "", "DaemonSet labels %v", c.agent.Labels)
		}}},
		"podLabels": {{[]string{"podLabels.k8s-app=istio-cni-node", "podLabels.team=mesh", "taintController.enabled=false"}, func(_ *testing.T, c *chart) error {
			l := c.agent.Spec.Template.Labels
			return expect(l["k8s-app"] == "istio-cni-node" && l["team"] == "mesh" && c.taint == nil, "pod labels %v", l)
		}}},
		"podAnnotations": {{[]string{"podAnnotations.example\\.com/owner=mesh"}, func(_ *testing.T, c *chart) error {
			return expect(c.agent.Spec.Template.Annotations["example.com/owner"] == "mesh" && c.agent.Spec.Template.Annotations["sidecar.istio.io/inject"] == "false", "annotations %v", c.agent.Spec.Template.Annotations)
		}}},
		"env": {{[]string{"env.GOMEMLIMIT=200MiB", "env.TRACE=true"}, func(_ *testing.T, c *chart) error {
			e := envOf(agentCt(c))
			return expect(e["GOMEMLIMIT"].Value == "200MiB" && e["TRACE"].Value == "true", "env %v", e)
		}}},
		"seccompProfile": {{[]string{"seccompProfile.type=Localhost", "seccompProfile.localhostProfile=profiles/meshcni.json"}, func(_ *testing.T, c *chart) error {
			sp := agentCt(c).SecurityContext.SeccompProfile
			return expect(sp != nil && sp.Type == corev1.SeccompProfileTypeLocalhost && *sp.LocalhostProfile == "profiles/meshcni.json", "container seccomp %+v", sp)
		}}},
		"seLinuxOptions": {{[]string{"seLinuxOptions.level=s0:c1"}, func(_ *testing.T, c *chart) error {
			se := agentCt(c).SecurityContext.SELinuxOptions
			return expect(se != nil && se.Type == "spc_t" && se.Level == "s0:c1", "SELinux %+v", se)
		}}},
		"useAppArmorAnnotation": {
			{[]string{"useAppArmorAnnotation=true"}, func(_ *testing.T, c *chart) error {
				a := c.agent.Spec.Template.Annotations["container.apparmor.security.beta.kubernetes.io/agent"]
				return expect(a == "unconfined" && agentCt(c).SecurityContext.AppArmorProfile == nil && c.taint.Spec.Template.Annotations["container.apparmor.security.beta.kubernetes.io/agent"] == "", "annotation %q", a)
			}},
			{[]string{"useAppArmorAnnotation=false"}, func(_ *testing.T, c *chart) error {
				p := agentCt(c).SecurityContext.AppArmorProfile
				return expect(p != nil && p.Type == corev1.AppArmorProfileTypeUnconfined && c.agent.Spec.Template.Annotations["container.apparmor.security.beta.kubernetes.io/agent"] == "", "AppArmor profile %+v", p)
			}},
		},
		"resources": {{[]string{"resources.requests.cpu=100m", "resources.requests.memory=100Mi"}, func(_ *testing.T, c *chart) error {
			r := agentCt(c).Resources
			return expect(r.Requests.Cpu().String() == "100m" && r.Requests.Memory().String() == "100Mi", "resources %+v", r)
		}}},
		"global.defaultResources": {{[]string{"resources=null", "global.defaultResources.requests.cpu=200m"}, func(_ *testing.T, c *chart) error {
			r := agentCt(c).Resources
			return expect(r.Requests.Cpu().String() == "200m", "resources %+v", r)
		}}},
		"resourceQuotas.enabled": {{[]string{"resourceQuotas.enabled=true"}, func(_ *testing.T, c *chart) error {
			return expect(c.count("ResourceQuota") == 1, "%d ResourceQuotas", c.count("ResourceQuota"))
		}}},
		"resourceQuotas.pods": {{[]string{"resourceQuotas.enabled=true", "resourceQuotas.pods=3000"}, func(t *testing.T, c *chart) error {
			q := typed[corev1.ResourceQuota](t, c.find("ResourceQuota", "meshcni-critical-pods"))
			return expect(q.Spec.Hard.Pods().Value() == 3000, "quota %v", q.Spec.Hard)
		}}},
		"tolerations": {{[]string{`json:tolerations=[{"key":"CriticalAddonsOnly","operator":"Exists"}]`}, func(_ *testing.T, c *chart) error {
			want := []corev1.Toleration{{Key: "CriticalAddonsOnly", Operator: corev1.TolerationOpExists}}
			return expect(reflect.DeepEqual(agentSpec(c).Tolerations, want), "tolerations %+v", agentSpec(c).Tolerations)
		}}},
		"updateStrategy": {{[]string{"updateStrategy.type=OnDelete"}, func(_ *testing.T, c *chart) error {
			u := c.agent.Spec.UpdateStrategy
			return expect(u.Type == "OnDelete" && u.RollingUpdate == nil, "update strategy %+v", u)
		}}, {[]string{`json:updateStrategy={"type":"RollingUpdate","rollingUpdate":{"maxUnavailable":"10%","maxSurge":0}}`}, func(_ *testing.T, c *chart) error {
			u := c.agent.Spec.UpdateStrategy
			return expect(u.RollingUpdate != nil && u.RollingUpdate.MaxUnavailable.String() == "10%", "update strategy %+v", u)
		}}},
		"terminationGracePeriodSeconds": {{[]string{"terminationGracePeriodSeconds=45"}, func(_ *testing.T, c *chart) error {
			g := agentSpec(c).TerminationGracePeriodSeconds
			return expect(g != nil && *g == 45, "grace %v", g)
		}}},
	}
}

// checkMultus: the NetworkAttachmentDefinition Istio's chart renders (default/istio-cni,
// no spec), and the standalone list answering to that name.
func checkMultus(t *testing.T, c *chart) error {
	nad := c.find("NetworkAttachmentDefinition", "istio-cni")
	if nad == nil || c.count("NetworkAttachmentDefinition") != 1 {
		return errorf("want one NetworkAttachmentDefinition istio-cni, have %d", c.count("NetworkAttachmentDefinition"))
	}
	if nad.GetAPIVersion() != "k8s.cni.cncf.io/v1" || nad.GetNamespace() != "default" || nad.Object["spec"] != nil {
		return errorf("NetworkAttachmentDefinition %s", yamlOf(t, nad))
	}
	return expect(!c.agentC.Chained && c.agentC.NetworkName == "istio-cni", "chained %v, network name %q", c.agentC.Chained, c.agentC.NetworkName)
}

// TestIstioValuesMapped: every Istio value the table maps has cases here, and each
// renders with the effect Istio's chart gives it (and passes every check of load).
func TestIstioValuesMapped(t *testing.T) {
	cases := mappedCases()
	for _, e := range compatTable(t) {
		if _, ok := cases[e.Istio]; e.Meshcni != "" && !ok {
			t.Errorf("%s is mapped (%s) but has no case here", e.Istio, e.Meshcni)
		}
	}
	for key, cs := range cases {
		for i, tc := range cs {
			t.Run(fmt.Sprintf("%s/%d", key, i), func(t *testing.T) {
				if err := tc.check(t, load(t, tc.values)); err != nil {
					t.Errorf("%v: %v", tc.values, err)
				}
			})
		}
	}
}

// checkIstioValues: testdata/istio-cni-production.yaml over Istio's defaults, value by
// value as Istio's chart would apply it.
func checkIstioValues(t *testing.T, c *chart) {
	a, ds, ps, ct := c.agentC, c.agent, agentSpec(c), agentCt(c)
	if ct.Image != "registry.corp.example/mesh/meshcni@"+testDigest || ct.ImagePullPolicy != corev1.PullAlways ||
		!reflect.DeepEqual(ps.ImagePullSecrets, []corev1.LocalObjectReference{{Name: "corp-registry"}}) {
		t.Errorf("image %q %s, pull secrets %v", ct.Image, ct.ImagePullPolicy, ps.ImagePullSecrets)
	}
	// default:info wins over cni:debug: meshcni has one level, the default scope's.
	if a.LogLevel.String() != "INFO" || a.Backend != "nftables" {
		t.Errorf("log level %s, backend %s", a.LogLevel, a.Backend)
	}
	if a.Chained || a.CNIBinDir != "/var/lib/cni/bin" || a.CNIConfDir != "/etc/cni/multus/net.d" || a.NetworkName != "istio-cni" {
		t.Errorf("CNI config: chained %v, bin %s, conf %s, network %q", a.Chained, a.CNIBinDir, a.CNIConfDir, a.NetworkName)
	}
	if err := checkMultus(t, c); err != nil {
		t.Error(err)
	}
	if strings.Join(a.ExcludeNamespaces, ",") != "kube-system,openshift-monitoring" {
		t.Errorf("exclude %v", a.ExcludeNamespaces)
	}
	if !a.Repair || a.RepairAction != repair.ActionRepair || a.RepairInitContainer != "istio-validation" || a.RepairExitCode != 126 ||
		len(a.RepairNetnsDirs) == 0 || a.RepairNetnsDirs[0] != "/var/run/crio/netns" || !mountPaths(c)["/var/run/crio/netns"] {
		t.Errorf("repair %v %s %s %d, netns dirs %v", a.Repair, a.RepairAction, a.RepairInitContainer, a.RepairExitCode, a.RepairNetnsDirs)
	}
	if l := ds.Spec.Template.Labels; l["k8s-app"] != "istio-cni-node" || l["team"] != "mesh" || ds.Labels["team"] != "mesh" || c.taint != nil {
		t.Errorf("pod labels %v, DaemonSet labels %v, taint controller %v", l, ds.Labels, c.taint != nil)
	}
	if an := ds.Spec.Template.Annotations; an["example.com/owner"] != "mesh-team" || an["container.apparmor.security.beta.kubernetes.io/agent"] != "" {
		t.Errorf("annotations %v", an)
	}
	if ps.Affinity == nil || ps.Affinity.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms[0].MatchExpressions[0].Key != "node-role.kubernetes.io/infra" {
		t.Errorf("affinity %+v", ps.Affinity)
	}
	if u := ds.Spec.UpdateStrategy; u.RollingUpdate == nil || u.RollingUpdate.MaxUnavailable.String() != "10%" {
		t.Errorf("update strategy %+v", u)
	}
	if e := envOf(ct); e["GOMEMLIMIT"].Value != "200MiB" {
		t.Errorf("env %v", e)
	}
	if r := ct.Resources; r.Requests.Cpu().String() != "50m" || r.Requests.Memory().String() != "64Mi" || r.Limits.Memory().String() != "256Mi" {
		t.Errorf("resources %+v", r)
	}
	sc := ct.SecurityContext
	if sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault || sc.SELinuxOptions == nil || sc.SELinuxOptions.Type != "spc_t" ||
		sc.AppArmorProfile == nil || sc.AppArmorProfile.Type != corev1.AppArmorProfileTypeUnconfined {
		t.Errorf("security context %+v", sc)
	}
	// Istio's default tolerations: every NoSchedule and NoExecute taint, the not-ready one too.
	if !tolerates(ps.Tolerations, corev1.Taint{Key: "cni.istio.io/not-ready", Effect: corev1.TaintEffectNoSchedule}) {
		t.Errorf("tolerations %+v", ps.Tolerations)
	}
	if g := ps.TerminationGracePeriodSeconds; g == nil || *g != 45 {
		t.Errorf("grace %v", g)
	}
	if q := c.find("ResourceQuota", "meshcni-critical-pods"); q == nil || typed[corev1.ResourceQuota](t, q).Spec.Hard.Pods().Value() != 3000 {
		t.Errorf("ResourceQuota %s", yamlOf(t, q))
	}
}
