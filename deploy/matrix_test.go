package deploy_test

import (
	"fmt"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/pkg/agent"
	"github.com/meshcni/meshcni/pkg/repair"
	"github.com/meshcni/meshcni/pkg/taint"
)

// matrixCase is a set of values (--set, or @file for --values) and what its rendering
// must show beyond the checks of every rendering (load).
type matrixCase struct {
	name   string
	values []string
	check  func(t *testing.T, c *chart)
}

func agentEnv(c *chart) map[string]corev1.EnvVar {
	return envOf(c.agent.Spec.Template.Spec.Containers[0])
}

func mountPaths(c *chart) map[string]bool {
	m := map[string]bool{}
	for _, v := range c.agent.Spec.Template.Spec.Containers[0].VolumeMounts {
		m[v.MountPath] = true
	}
	return m
}

// matrix is every combination the docs promise; the dry-run test sends each to the API server.
func matrix() []matrixCase {
	cases := []matrixCase{
		{name: "default", check: func(t *testing.T, c *chart) {
			if n := c.count("ResourceQuota"); n != 0 {
				t.Errorf("%d ResourceQuotas by default", n)
			}
			a := c.agentC
			if !a.Chained || a.CNIBinDir != "/opt/cni/bin" || a.CNIConfDir != "/etc/cni/net.d" || a.RunDir != "/var/run/meshcni" ||
				a.Backend != "auto" || a.KeepOnExit != agent.KeepAuto || strings.Join(a.ExcludeNamespaces, ",") != "kube-system" {
				t.Errorf("agent config %+v", a)
			}
			// Health and metrics on the node's IP only, not on every interface of the node.
			if a.HealthAddr != "["+standInHostIP+"]:9807" {
				t.Errorf("agent health addr %q, want the node's IP %s", a.HealthAddr, standInHostIP)
			}
			if caps := c.agent.Spec.Template.Spec.Containers[0].SecurityContext.Capabilities; caps == nil ||
				fmt.Sprint(caps.Drop) != "[ALL]" || fmt.Sprint(caps.Add) != "[NET_ADMIN NET_RAW SYS_ADMIN DAC_OVERRIDE]" {
				t.Errorf("agent capabilities %+v, want ALL dropped, NET_ADMIN, NET_RAW, SYS_ADMIN, DAC_OVERRIDE added", caps)
			}
			if !a.Repair || a.RepairAction != repair.ActionRepair || a.RepairInitContainer != "istio-validation" || a.RepairExitCode != 126 {
				t.Errorf("repair config %+v", a)
			}
			if a.PluginServiceAccount != "meshcni-plugin" || a.PluginTokenExpiration.String() != "1h0m0s" {
				t.Errorf("plugin identity %q, token expiration %v", a.PluginServiceAccount, a.PluginTokenExpiration)
			}
			ps := c.agent.Spec.Template.Spec
			if ps.PriorityClassName != "system-node-critical" || ps.HostPID {
				t.Errorf("priority class %q, hostPID %v", ps.PriorityClassName, ps.HostPID)
			}
			// Everything is tolerated: any taint, including the not-ready one.
			for _, tn := range []corev1.Taint{{Key: taint.TaintKey, Effect: taint.TaintEffect}, {Key: "node.kubernetes.io/not-ready", Effect: corev1.TaintEffectNoExecute}, {Key: "x", Value: "y", Effect: corev1.TaintEffectNoSchedule}} {
				if !tolerates(ps.Tolerations, tn) {
					t.Errorf("agent does not tolerate %v", tn)
				}
			}
			if img := ps.Containers[0].Image; img != "ghcr.io/meshcni/meshcni:0.1.0" {
				t.Errorf("image %q, want the chart's appVersion", img)
			}
			if c.taint == nil || *c.taint.Spec.Replicas != 2 || !c.taintC.LeaderElect || c.taint.Spec.Template.Spec.HostNetwork {
				t.Errorf("taint controller %+v", c.taint)
			} else if c.taintC.GracePeriod.String() != "30s" || !c.taintC.TaintNewNodes {
				t.Errorf("taint config %+v", c.taintC)
			}
			if n := c.count("ServiceMonitor"); n != 0 {
				t.Errorf("%d ServiceMonitors by default", n)
			}
			if _, ok := agentEnv(c)["KUBERNETES_SERVICE_HOST"]; ok {
				t.Error("KUBERNETES_SERVICE_HOST set by default")
			}
			// The eviction budget's defaults are the agent's: nothing passed.
			for k := range agentEnv(c) {
				if strings.HasPrefix(k, "MESHCNI_HEAL_") {
					t.Errorf("%s set by default", k)
				}
			}
		}},
		{name: "openshift-standalone", values: []string{"chained=false", "cniConfDir=/etc/cni/multus/net.d", "cniBinDir=/var/lib/cni/bin", "cniConfFileName=00-multus.conf", "securityContext.privileged=true"}, check: func(t *testing.T, c *chart) {
			a := c.agentC
			if a.Chained || a.StandaloneFileName != "meshcni.conflist" || a.CNIConfDir != "/etc/cni/multus/net.d" || a.CNIConfFileName != "" ||
				!*c.agent.Spec.Template.Spec.Containers[0].SecurityContext.Privileged || c.agent.Spec.Template.Spec.Containers[0].SecurityContext.AllowPrivilegeEscalation != nil {
				t.Errorf("agent config %+v", a)
			}
		}},
		{name: "chained-conf-file", values: []string{"cniConfFileName=10-calico.conflist"}, check: func(t *testing.T, c *chart) {
			if c.agentC.CNIConfFileName != "10-calico.conflist" {
				t.Errorf("conf file name %q", c.agentC.CNIConfFileName)
			}
		}},
		{name: "gke", values: []string{"cniBinDir=/home/kubernetes/bin", "resourceQuotas.enabled=true"}, check: func(t *testing.T, c *chart) {
			if c.agentC.CNIBinDir != "/home/kubernetes/bin" || !mountPaths(c)["/home/kubernetes/bin"] || mountPaths(c)["/opt/cni/bin"] {
				t.Errorf("bin dir %q, mounts %v", c.agentC.CNIBinDir, mountPaths(c))
			}
			rq := c.find("ResourceQuota", "meshcni-critical-pods")
			if rq == nil {
				t.Fatal("no ResourceQuota")
			}
			q := typed[corev1.ResourceQuota](t, rq)
			want := []string{c.agent.Spec.Template.Spec.PriorityClassName, c.taint.Spec.Template.Spec.PriorityClassName}
			if q.Spec.ScopeSelector == nil || len(q.Spec.ScopeSelector.MatchExpressions) != 1 ||
				strings.Join(q.Spec.ScopeSelector.MatchExpressions[0].Values, ",") != strings.Join(want, ",") || q.Spec.Hard.Pods().Value() != 5000 {
				t.Errorf("ResourceQuota %s, want the scope %v", yamlOf(t, rq), want)
			}
		}},
		{name: "k3s", values: []string{"cniBinDir=/var/lib/rancher/k3s/data/current/bin", "cniConfDir=/var/lib/rancher/k3s/agent/etc/cni/net.d",
			"repair.netnsDirs={/run/k3s/containerd/io.containerd.grpc.v1.cri/netns,/var/run/netns}"}, check: func(t *testing.T, c *chart) {
			if c.agentC.CNIConfDir != "/var/lib/rancher/k3s/agent/etc/cni/net.d" || !mountPaths(c)["/run/k3s/containerd/io.containerd.grpc.v1.cri/netns"] ||
				strings.Join(c.agentC.RepairNetnsDirs, ",") != "/run/k3s/containerd/io.containerd.grpc.v1.cri/netns,/var/run/netns" {
				t.Errorf("config %+v, mounts %v", c.agentC, mountPaths(c))
			}
		}},
		// evict (delete its alias) is granted only by name: no policy fences an Eviction.
		{name: "repair-evict-not-granted", values: []string{"repair.action=evict"}, check: func(t *testing.T, c *chart) {
			if c.agentC.RepairAction != repair.ActionRepair || !mountPaths(c)["/var/run/netns"] {
				t.Errorf("action %s, mounts %v: want repair in place without rbac.unfencedPodWrites evict", c.agentC.RepairAction, mountPaths(c))
			}
		}},
		{name: "repair-delete-not-granted", values: []string{"repair.action=delete"}, check: func(t *testing.T, c *chart) {
			if c.agentC.RepairAction != repair.ActionRepair {
				t.Errorf("action %s: want repair in place without rbac.unfencedPodWrites evict", c.agentC.RepairAction)
			}
		}},
		{name: "repair-evict", values: []string{"repair.action=evict", "rbac.unfencedPodWrites={evict}"}, check: func(t *testing.T, c *chart) {
			// The audit (on by default) still enters pods' network namespaces.
			if !evicts(string(c.agentC.RepairAction)) || !mountPaths(c)["/var/run/netns"] {
				t.Errorf("action %s, mounts %v (netns dirs are for the audit too)", c.agentC.RepairAction, mountPaths(c))
			}
		}},
		{name: "repair-delete-alias", values: []string{"repair.action=delete", "rbac.unfencedPodWrites={delete}"}, check: func(t *testing.T, c *chart) {
			if !evicts(string(c.agentC.RepairAction)) {
				t.Errorf("action %s: delete is evict", c.agentC.RepairAction)
			}
		}},
		{name: "audit-escaped-default", check: func(t *testing.T, c *chart) {
			if c.agentC.AuditEscapedAction != "repair" || c.agentC.AuditPeriod.String() != "1m0s" {
				t.Errorf("audit config %s %s", c.agentC.AuditEscapedAction, c.agentC.AuditPeriod)
			}
		}},
		{name: "audit-escaped-report", values: []string{"audit.escapedAction=report"}, check: func(t *testing.T, c *chart) {
			if c.agentC.AuditEscapedAction != "report" {
				t.Errorf("escaped action %s", c.agentC.AuditEscapedAction)
			}
		}},
		{name: "audit-escaped-evict-not-granted", values: []string{"audit.escapedAction=evict"}, check: func(t *testing.T, c *chart) {
			if c.agentC.AuditEscapedAction != "repair" {
				t.Errorf("escaped action %s: want repair without rbac.unfencedPodWrites evict", c.agentC.AuditEscapedAction)
			}
		}},
		{name: "audit-escaped-evict", values: []string{"audit.escapedAction=evict", "rbac.unfencedPodWrites={evict}"}, check: func(t *testing.T, c *chart) {
			if !evicts(string(c.agentC.AuditEscapedAction)) {
				t.Errorf("escaped action %s, want the agent's delete (evict)", c.agentC.AuditEscapedAction)
			}
		}},
		{name: "repair-evict-audit-off", values: []string{"repair.action=evict", "rbac.unfencedPodWrites={evict}", "audit.period=0s"}, check: func(t *testing.T, c *chart) {
			if !evicts(string(c.agentC.RepairAction)) || c.agentC.AuditPeriod != 0 || mountPaths(c)["/var/run/netns"] {
				t.Errorf("action %s, audit period %s, mounts %v (netns dirs only for repair in place or the audit)", c.agentC.RepairAction, c.agentC.AuditPeriod, mountPaths(c))
			}
		}},
		// Any zero duration turns the audit off, in the chart as in the agent: no netns
		// mounts, no eviction grant for an escapedAction that never runs.
		{name: "audit-off-0m", values: []string{"repair.enabled=false", "audit.period=0m", "audit.escapedAction=evict", "rbac.unfencedPodWrites={evict}"}, check: func(t *testing.T, c *chart) {
			if c.agentC.AuditPeriod != 0 || mountPaths(c)["/var/run/netns"] {
				t.Errorf("audit period %s, mounts %v: want the audit off and no netns mounts", c.agentC.AuditPeriod, mountPaths(c))
			}
		}},
		{name: "repair-label", values: []string{"repair.action=label", "repair.labelKey=example.com/broken", `repair.labelSelector=app in (a\,b)`, "repair.fieldSelector=metadata.namespace!=batch"}, check: func(t *testing.T, c *chart) {
			a := c.agentC
			if a.RepairAction != repair.ActionLabel || a.RepairLabelKey != "example.com/broken" || a.RepairLabelSelector != "app in (a,b)" || a.RepairFieldSelector != "metadata.namespace!=batch" {
				t.Errorf("repair config %+v", a)
			}
		}},
		{name: "repair-hostproc", values: []string{"repair.hostProc=true", "repair.initContainerName=mesh-check", "repair.exitCode=42", `repair.message=no redirect.*`}, check: func(t *testing.T, c *chart) {
			if !c.agent.Spec.Template.Spec.HostPID || c.agentC.RepairInitContainer != "mesh-check" || c.agentC.RepairExitCode != 42 || c.agentC.RepairMessage != "no redirect.*" {
				t.Errorf("hostPID %v, config %+v", c.agent.Spec.Template.Spec.HostPID, c.agentC)
			}
			if caps := c.agent.Spec.Template.Spec.Containers[0].SecurityContext.Capabilities; caps == nil || fmt.Sprint(caps.Add) != "[NET_ADMIN NET_RAW SYS_ADMIN DAC_OVERRIDE SYS_PTRACE]" {
				t.Errorf("agent capabilities %+v, want SYS_PTRACE added for repair.hostProc", caps)
			}
		}},
		{name: "repair-off", values: []string{"repair.enabled=false", "repair.hostProc=true", "audit.period=0s"}, check: func(t *testing.T, c *chart) {
			if c.agentC.Repair || c.agent.Spec.Template.Spec.HostPID || mountPaths(c)["/var/run/netns"] {
				t.Errorf("repair %v, hostPID %v, mounts %v", c.agentC.Repair, c.agent.Spec.Template.Spec.HostPID, mountPaths(c))
			}
		}},
		{name: "taint-off", values: []string{"taintController.enabled=false"}, check: func(t *testing.T, c *chart) {
			if n := c.count("Deployment"); n != 0 {
				t.Errorf("%d Deployments with the taint controller off", n)
			}
			// Left: the agent's and the plugin's ServiceAccounts and ClusterRoles, the
			// agent's Roles: its own DaemonSet (keepOnUpgrade auto) and minting the
			// plugin's token.
			for _, k := range []string{"Role", "RoleBinding"} {
				if n := c.count(k); n != 2 || c.find(k, "meshcni-agent") == nil || c.find(k, "meshcni-agent-plugin-token") == nil {
					t.Errorf("%d %s objects with the taint controller off, want the agent's two", n, k)
				}
			}
			if c.count("ServiceAccount") != 2 || c.count("ClusterRole") != 2 || c.count("Service") != 1 {
				t.Errorf("objects: %d ServiceAccounts, %d ClusterRoles, %d Services", c.count("ServiceAccount"), c.count("ClusterRole"), c.count("Service"))
			}
		}},
		{name: "taint-single", values: []string{"taintController.replicas=1", "taintController.leaderElect=false", "taintController.hostNetwork=true",
			"taintController.gracePeriod=1m30s", "taintController.taintNewNodes=false", "taintController.nodeSelectorLabels=pool=meshed", "taintController.logLevel=debug",
			"taintController.taintMode=always", "taintController.maxTaintedFraction=0.25", "taintController.maxTaintedFloor=3"}, check: func(t *testing.T, c *chart) {
			tc := c.taintC
			if tc.LeaderElect || tc.GracePeriod.String() != "1m30s" || tc.TaintNewNodes || tc.NodeSelector.String() != "pool=meshed" || tc.LogLevel.String() != "DEBUG" {
				t.Errorf("taint config %+v", tc)
			}
			if tc.TaintMode != taint.Always || tc.MaxTaintedFraction != 0.25 || tc.MaxTaintedFloor != 3 {
				t.Errorf("taint mode %s, fraction %v, floor %d; want always, 0.25, 3", tc.TaintMode, tc.MaxTaintedFraction, tc.MaxTaintedFloor)
			}
			if !c.taint.Spec.Template.Spec.HostNetwork || c.find("Role", "meshcni-taint-controller") == nil {
				t.Errorf("hostNetwork %v", c.taint.Spec.Template.Spec.HostNetwork)
			}
			if strings.Contains(yamlOf(t, c.find("Role", "meshcni-taint-controller")), "leases") {
				t.Error("lease permissions without leader election")
			}
		}},
		// Without nodeSelectorLabels, the taint controller manages the agent's nodes only.
		{name: "taint-nodes-follow-agent", values: []string{"nodeSelector.pool=meshed"}, check: func(t *testing.T, c *chart) {
			if got := c.taintC.NodeSelector.String(); got != "kubernetes.io/os=linux,pool=meshed" {
				t.Errorf("taint controller node selector %q, want the agent's nodeSelector", got)
			}
		}},
		{name: "taint-nodes-all", values: []string{"nodeSelector=null"}, check: func(t *testing.T, c *chart) {
			if len(c.agent.Spec.Template.Spec.NodeSelector) != 0 || !c.taintC.NodeSelector.Empty() {
				t.Errorf("agent nodeSelector %v, taint controller node selector %q: want every node", c.agent.Spec.Template.Spec.NodeSelector, c.taintC.NodeSelector)
			}
		}},
		{name: "admission-policies-off", values: []string{"admissionPolicies.enabled=false", "plugin.tokenExpiration=10m"}, check: func(t *testing.T, c *chart) {
			if c.agentC.PluginTokenExpiration.String() != "10m0s" {
				t.Errorf("plugin token expiration %v", c.agentC.PluginTokenExpiration)
			}
		}},
		{name: "servicemonitor", values: []string{"metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.interval=15s", "metrics.serviceMonitor.labels.release=prometheus", "metrics.port=19807"}, check: func(t *testing.T, c *chart) {
			sm := c.find("ServiceMonitor", "meshcni")
			if sm == nil {
				t.Fatal("no ServiceMonitor")
			}
			if sm.GetLabels()["release"] != "prometheus" || !strings.Contains(yamlOf(t, sm), "interval: 15s") || c.agentC.HealthAddr != "["+standInHostIP+"]:19807" {
				t.Errorf("ServiceMonitor %s, health addr %s", yamlOf(t, sm), c.agentC.HealthAddr)
			}
		}},
		{name: "image-and-levels", values: []string{"hub=registry.example.com:5000/mesh/", "tag=v1.2.3", "pullPolicy=Always", "imagePullSecrets[0].name=regcred",
			"logLevel=warn", "pluginLogLevel=debug", "excludeNamespaces={kube-system,istio-system}", "keepOnUpgrade=true", "podAnnotations.a=b"}, check: func(t *testing.T, c *chart) {
			ps := c.agent.Spec.Template.Spec
			if ps.Containers[0].Image != "registry.example.com:5000/mesh/meshcni:v1.2.3" || ps.Containers[0].ImagePullPolicy != corev1.PullAlways ||
				len(ps.ImagePullSecrets) != 1 || ps.ImagePullSecrets[0].Name != "regcred" || c.agent.Spec.Template.Annotations["a"] != "b" {
				t.Errorf("agent pod %+v", ps)
			}
			a := c.agentC
			if a.LogLevel.String() != "WARN" || a.PluginLogLevel != "debug" || strings.Join(a.ExcludeNamespaces, ",") != "kube-system,istio-system" || a.KeepOnExit != agent.KeepAlways {
				t.Errorf("agent config %+v", a)
			}
			if c.agent.Labels["app.kubernetes.io/version"] != "v1.2.3" {
				t.Errorf("version label %q", c.agent.Labels["app.kubernetes.io/version"])
			}
		}},
		{name: "keep-never", values: []string{"keepOnUpgrade=never"}, check: func(t *testing.T, c *chart) {
			if c.agentC.KeepOnExit != agent.KeepNever || c.find("Role", "meshcni-agent") != nil {
				t.Errorf("keep %s, agent Role %v", c.agentC.KeepOnExit, c.find("Role", "meshcni-agent") != nil)
			}
		}},
		{name: "keep-false", values: []string{"keepOnUpgrade=false"}, check: func(t *testing.T, c *chart) {
			if c.agentC.KeepOnExit != agent.KeepNever {
				t.Errorf("keep %s", c.agentC.KeepOnExit)
			}
		}},
		{name: "metrics-loopback", values: []string{"metrics.bindAddress=127.0.0.1"}, check: func(t *testing.T, c *chart) {
			ct := c.agent.Spec.Template.Spec.Containers[0]
			if c.agentC.HealthAddr != "[127.0.0.1]:9807" || ct.ReadinessProbe.HTTPGet.Host != "127.0.0.1" || ct.LivenessProbe.HTTPGet.Host != "127.0.0.1" {
				t.Errorf("health addr %q, probes ask %q and %q", c.agentC.HealthAddr, ct.ReadinessProbe.HTTPGet.Host, ct.LivenessProbe.HTTPGet.Host)
			}
			if _, ok := agentEnv(c)["HOST_IP"]; ok {
				t.Error("HOST_IP set without use")
			}
		}},
		{name: "metrics-everywhere", values: []string{"metrics.bindAddress=::"}, check: func(t *testing.T, c *chart) {
			ct := c.agent.Spec.Template.Spec.Containers[0]
			if c.agentC.HealthAddr != "[::]:9807" || ct.ReadinessProbe.HTTPGet.Host != "" {
				t.Errorf("health addr %q, probe asks %q", c.agentC.HealthAddr, ct.ReadinessProbe.HTTPGet.Host)
			}
		}},
		{name: "api-server", values: []string{"apiServer.host=10.0.0.1"}, check: func(t *testing.T, c *chart) {
			for _, ct := range []corev1.Container{c.agent.Spec.Template.Spec.Containers[0], c.taint.Spec.Template.Spec.Containers[0]} {
				e := envOf(ct)
				if e["KUBERNETES_SERVICE_HOST"].Value != "10.0.0.1" || e["KUBERNETES_SERVICE_PORT"].Value != "443" {
					t.Errorf("%s: API server env %v", ct.Name, e)
				}
			}
		}},
		// A values file written for Istio's istio-cni chart (its defaults, then a production
		// override on OpenShift) plus the one meshcni line it needs: istiod's untaint
		// controller (podLabels k8s-app) instead of meshcni's.
		// Istio's chart defaults alone: meshcni's image under Istio's global.hub and tag,
		// Istio's tolerations and resources, the agent AppArmor-unconfined by annotation.
		{name: "istio-defaults", values: []string{"@" + istioDefaultsFile}, check: func(t *testing.T, c *chart) {
			ct := c.agent.Spec.Template.Spec.Containers[0]
			if ct.Image != "registry.istio.io/testing/meshcni:latest" || ct.ImagePullPolicy != "" || c.agent.Spec.Template.Annotations["container.apparmor.security.beta.kubernetes.io/agent"] != "unconfined" ||
				ct.Resources.Requests.Cpu().String() != "100m" || !c.agentC.Chained || !c.agentC.Repair || c.agentC.RepairAction != repair.ActionRepair || c.count("NetworkAttachmentDefinition") != 0 {
				t.Errorf("agent %s %q, annotations %v, resources %v, config %+v", ct.Image, ct.ImagePullPolicy, c.agent.Spec.Template.Annotations, ct.Resources, c.agentC)
			}
		}},
		{name: "istio-values", values: []string{"@" + istioDefaultsFile, "@" + istioProductionFile, "taintController.enabled=false"}, check: checkIstioValues},
		{name: "testbed", values: []string{"@testbed-values.yaml"}, check: func(t *testing.T, c *chart) {
			if c.agentC.CNIBinDir != "/var/lib/meshcni-testbed/cni/bin" || agentEnv(c)["KUBERNETES_SERVICE_PORT"].Value != "6443" ||
				c.agent.Spec.Template.Spec.Containers[0].Image != "meshcni.local/meshcni:dev" || *c.taint.Spec.Replicas != 1 ||
				c.agent.Spec.Template.Spec.HostPID || strings.Join(c.agentC.RepairNetnsDirs, ",") != testbed.NetnsDir || !mountPaths(c)[testbed.NetnsDir] {
				t.Errorf("agent config %+v", c.agentC)
			}
		}},
	}
	for _, b := range []string{"auto", "nftables", "iptables-nft", "iptables-legacy"} {
		cases = append(cases, matrixCase{name: "backend-" + b, values: []string{"backend=" + b}, check: func(t *testing.T, c *chart) {
			if c.agentC.Backend != b {
				t.Errorf("agent backend %q, want %q", c.agentC.Backend, b)
			}
		}})
	}
	for _, m := range []string{"istio", "capture", "drop"} {
		cases = append(cases, matrixCase{name: "ipv6-" + m, values: []string{"ipv6=" + m}, check: func(t *testing.T, c *chart) {
			pol, err := c.agentC.RepairPolicy()
			if err != nil {
				t.Fatal(err)
			}
			if string(c.agentC.IPv6) != m || string(pol.Mesh.IPv6) != m {
				t.Errorf("agent ipv6 %q, repair %q, want %q", c.agentC.IPv6, pol.Mesh.IPv6, m)
			}
			// The plugin entry carries a non-default mode; the default (istio) is left out.
			want := m
			if m == "istio" {
				want = ""
			}
			if got := c.agentC.Entry().IPv6; got != want {
				t.Errorf("plugin entry ipv6 %q, want %q", got, want)
			}
		}})
	}
	return cases
}

// TestTemplateMatrix renders every case and checks it (load: labels, the agent's and the
// taint controller's own parsers accept the env, mounts, probes, RBAC, Services).
func TestTemplateMatrix(t *testing.T) {
	for _, tc := range matrix() {
		t.Run(tc.name, func(t *testing.T) {
			tc.check(t, load(t, tc.values))
		})
	}
}

// TestLint runs `helm lint --strict` on the default values and on every case.
func TestLint(t *testing.T) {
	for _, tc := range matrix() {
		t.Run(tc.name, func(t *testing.T) {
			args := templateArgs(namespace, tc.values)
			args = append([]string{"lint", chartDir, "--strict", "--namespace", namespace}, args[5:]...)
			out, err := runHelm(t, args...)
			if err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(out, "1 chart(s) linted, 0 chart(s) failed") {
				t.Fatalf("helm lint: %s", out)
			}
		})
	}
}

// TestSchemaRejects: bad values fail helm template and helm lint with the schema's error
// naming the value.
func TestSchemaRejects(t *testing.T) {
	for _, tc := range []struct{ set, want string }{
		{"backend=foo", "at '/backend': value must be one of 'auto', 'nftables', 'iptables-nft', 'iptables-legacy'"},
		{"backend=iptables", "at '/backend'"},
		{"ipv6=pass", "at '/ipv6': value must be one of 'istio', 'capture', 'drop'"},
		{"repair.action=nuke", "at '/repair/action': value must be one of 'repair', 'evict', 'delete', 'label'"},
		{"audit.escapedAction=nuke", "at '/audit/escapedAction': value must be one of 'repair', 'evict', 'delete', 'report'"},
		{"rbac.unfencedPodWrites={update}", "at '/rbac/unfencedPodWrites/0'"},
		{"heal.maxEvictions=0", "at '/heal/maxEvictions'"},
		{"heal.maxEvictFraction=1.5", "at '/heal/maxEvictFraction'"},
		{"heal.maxEvictFraction=0", "at '/heal/maxEvictFraction'"},
		{"heal.evictionWindow=soon", "at '/heal/evictionWindow'"},
		{"repair.exitCode=300", "at '/repair/exitCode'"},
		{"repair.initContainerName=Bad_Name", "at '/repair/initContainerName'"},
		{"repair.netnsDirs={relative/dir}", "at '/repair/netnsDirs/0'"},
		{"cniBinDir=opt/cni/bin", "at '/cniBinDir'"},
		{"cniConfDir=/a\\,b", "at '/cniConfDir'"},
		{"cniConfFileName=../etc/passwd", "at '/cniConfFileName'"},
		{"standaloneFileName=meshcni.conf", "at '/standaloneFileName'"},
		{"chained=maybe", "at '/chained'"},
		{"logLevel=verbose", "at '/logLevel'"},
		{"pullPolicy=Sometimes", "at '/pullPolicy'"},
		{"excludeNamespaces={Kube_System}", "at '/excludeNamespaces/0'"},
		{"metrics.port=0", "at '/metrics/port'"},
		{"metrics.port=70000", "at '/metrics/port'"},
		{"taintController.gracePeriod=soon", "at '/taintController/gracePeriod'"},
		{"taintController.taintMode=never", "at '/taintController/taintMode'"},
		{"taintController.maxTaintedFraction=1.5", "at '/taintController/maxTaintedFraction'"},
		{"taintController.maxTaintedFraction=10%", "at '/taintController/maxTaintedFraction'"},
		{"taintController.maxTaintedFloor=-1", "at '/taintController/maxTaintedFloor'"},
		{"taintController.leaderElect=false", "at '/taintController/replicas'"},
		{"apiServer.port=-1", "at '/apiServer/port'"},
		{"keepOnUpgrade=maybe", "at '/keepOnUpgrade'"},
		{"metrics.bindAddress=localhost", "at '/metrics/bindAddress'"},
		{"metrics.bindAddress=", "at '/metrics/bindAddress'"},
		{"plugin.tokenExpiration=1 hour", "at '/plugin/tokenExpiration'"},
		{"admissionPolicies.enabled=maybe", "at '/admissionPolicies/enabled'"},
		{"hub=", "at '/hub'"},
		{"tpyo=1", "additional properties 'tpyo' not allowed"},
		{"repair.actoin=delete", "additional properties 'actoin' not allowed"},
	} {
		t.Run(tc.set, func(t *testing.T) {
			_, err := runHelm(t, templateArgs(namespace, []string{tc.set})...)
			if err == nil || !strings.Contains(err.Error(), "values don't meet the specifications of the schema") || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("helm template --set %s: %v\nwant the schema error %q", tc.set, err, tc.want)
			}
			if _, err := runHelm(t, "lint", chartDir, "--strict", "--set", tc.set); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("helm lint --set %s: %v\nwant %q", tc.set, err, tc.want)
			}
		})
	}
}
