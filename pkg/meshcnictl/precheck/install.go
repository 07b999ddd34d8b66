package precheck

import (
	"fmt"
	"sort"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
)

// A product whose node DaemonSet precheck looks for.
type product struct {
	name     string
	selector labels.Set // labels of its node pods
	// not: pods of another product that may carry selector too (meshcni's agent
	// wears k8s-app=istio-cni-node for istiod's untaint controller).
	not labels.Set
}

func (p product) matches(l map[string]string) bool {
	set := labels.Set(l)
	return p.selector.AsSelector().Matches(set) && (p.not == nil || !p.not.AsSelector().Matches(set))
}

var (
	// istioCNI: Istio's istio-cni chart labels its pods k8s-app=istio-cni-node (the
	// label istiod's untaint controller selects).
	istioCNI = product{name: "Istio's istio-cni", selector: labels.Set{"k8s-app": "istio-cni-node"}, not: meshcniAgent}
	// meshcni: the selector labels of meshcni's chart for the agent.
	meshcni      = product{name: "meshcni", selector: meshcniAgent}
	meshcniAgent = labels.Set{"app.kubernetes.io/name": "meshcni", "app.kubernetes.io/component": "agent"}
)

// MeshcniAgentSelector is the label selector of meshcni's agent pods (the chart's).
func MeshcniAgentSelector() string { return meshcni.selector.String() }

// NetworkNameEnv is the agent's environment variable naming its standalone network
// (the "name" of the list Multus finds by a NetworkAttachmentDefinition's name);
// unset, the network is DefaultNetworkName.
const NetworkNameEnv = "MESHCNI_NETWORK_NAME"

// DefaultNetworkName is the name of meshcni's standalone list.
const DefaultNetworkName = "meshcni"

// Install is where a CNI product runs.
type Install struct {
	// DaemonSets are namespace/name.
	DaemonSets []string `json:"daemonSets"`
	// ReadyNodes run one of its pods, Ready; NotReadyNodes one that is not.
	ReadyNodes    []string `json:"readyNodes"`
	NotReadyNodes []string `json:"notReadyNodes,omitempty"`
	// Chained is false for meshcni in standalone mode (Multus); nil when unknown.
	Chained *bool `json:"chained,omitempty"`
	// NetworkName is meshcni's standalone network name (standalone mode only).
	NetworkName string `json:"networkName,omitempty"`
}

func findInstall(in Input, p product) *Install {
	inst := &Install{}
	for i := range in.DaemonSets {
		ds := &in.DaemonSets[i]
		if !p.matches(ds.Spec.Template.Labels) {
			continue
		}
		inst.DaemonSets = append(inst.DaemonSets, ds.Namespace+"/"+ds.Name)
		if p.name == meshcni.name {
			chainedAndNetwork(ds, inst)
		}
	}
	ready, notReady := map[string]bool{}, map[string]bool{}
	for i := range in.Pods {
		pod := &in.Pods[i]
		if !p.matches(pod.Labels) || pod.Spec.NodeName == "" || pod.DeletionTimestamp != nil {
			continue
		}
		if podReady(pod) {
			ready[pod.Spec.NodeName] = true
		} else {
			notReady[pod.Spec.NodeName] = true
		}
	}
	for n := range ready {
		delete(notReady, n)
	}
	inst.ReadyNodes, inst.NotReadyNodes = sortedKeys(ready), sortedKeys(notReady)
	if len(inst.DaemonSets) == 0 && len(ready)+len(notReady) == 0 {
		return nil
	}
	return inst
}

// chainedAndNetwork reads the agent's MESHCNI_CHAINED and network name from its
// DaemonSet (the chart sets them as environment variables).
func chainedAndNetwork(ds *appsv1.DaemonSet, inst *Install) {
	for _, c := range ds.Spec.Template.Spec.Containers {
		for _, e := range c.Env {
			switch e.Name {
			case "MESHCNI_CHAINED":
				chained := !strings.EqualFold(strings.TrimSpace(e.Value), "false")
				inst.Chained = &chained
			case NetworkNameEnv:
				inst.NetworkName = e.Value
			}
		}
	}
	if inst.Chained != nil && !*inst.Chained && inst.NetworkName == "" {
		inst.NetworkName = DefaultNetworkName
	}
	if inst.Chained == nil || *inst.Chained {
		inst.NetworkName = ""
	}
}

func podReady(pod *corev1.Pod) bool {
	if pod.Status.Phase != corev1.PodRunning {
		return false
	}
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

func installFindings(inst *Install, p product) []Finding {
	check := "install"
	if inst == nil {
		return []Finding{{Severity: Info, Check: check, What: p.name + " is not installed (no DaemonSet or pod labelled " + p.selector.String() + ")"}}
	}
	what := fmt.Sprintf("%s is installed: DaemonSet %s, Ready on %s", p.name, listOr(inst.DaemonSets, "none (pods only)"), nodeList(inst.ReadyNodes))
	if inst.Chained != nil {
		if *inst.Chained {
			what += ", chained into the primary network"
		} else {
			what += ", standalone (Multus) network " + inst.NetworkName
		}
	}
	fs := []Finding{{Severity: Info, Check: check, What: what}}
	if len(inst.NotReadyNodes) > 0 {
		fs = append(fs, Finding{Severity: Warning, Check: check,
			What: fmt.Sprintf("%s's pod is not Ready on %s", p.name, nodeList(inst.NotReadyNodes)),
			Do:   "kubectl describe its pod there; a node's CNI is only as good as its Ready pod"})
	}
	return fs
}

// nodeFindings say which CNI covers each schedulable node, and which node no CNI
// covers while the injector relies on one.
func nodeFindings(nodes []corev1.Node, injs []Injector, istio, mesh *Install) []Finding {
	cniNeeded := false
	for _, inj := range injs {
		cniNeeded = cniNeeded || inj.CNIEnabled
	}
	on := func(inst *Install) map[string]bool {
		m := map[string]bool{}
		if inst != nil {
			for _, n := range inst.ReadyNodes {
				m[n] = true
			}
		}
		return m
	}
	istioOn, meshOn := on(istio), on(mesh)
	var neither, istioOnly, meshOnly, both []string
	for _, n := range nodes {
		if n.Spec.Unschedulable {
			continue
		}
		switch i, m := istioOn[n.Name], meshOn[n.Name]; {
		case i && m:
			both = append(both, n.Name)
		case i:
			istioOnly = append(istioOnly, n.Name)
		case m:
			meshOnly = append(meshOnly, n.Name)
		default:
			neither = append(neither, n.Name)
		}
	}
	var fs []Finding
	if len(neither) > 0 && cniNeeded {
		fs = append(fs, Finding{Severity: Blocker, Check: "nodes",
			What: fmt.Sprintf("no CNI redirect is Ready on %s while the injector relies on one: meshed pods started there fail istio-validation, or run unredirected without it", nodeList(neither)),
			Do:   "install meshcni (or keep istio-cni) there and wait until its pod is Ready before starting meshed pods"})
	}
	if len(istioOnly) > 0 {
		f := Finding{Severity: Info, Check: "nodes", What: "only istio-cni redirects on " + nodeList(istioOnly),
			Do: "install meshcni and wait for its agent to be Ready there before removing istio-cni"}
		if mesh != nil {
			f.Severity, f.What = Warning, "meshcni's agent is not Ready on "+nodeList(istioOnly)+", which istio-cni alone covers"
			f.Do = "do not remove istio-cni there until meshcni's agent is Ready (kubectl describe its pod)"
		}
		fs = append(fs, f)
	}
	if len(both) > 0 {
		fs = append(fs, Finding{Severity: Info, Check: "nodes",
			What: "istio-cni and meshcni are both Ready on " + nodeList(both) + ": a new pod is redirected by both (the same rules, harmless)",
			Do:   "remove istio-cni there to finish the switch (docs/migration.md)"})
	}
	if len(meshOnly) > 0 {
		fs = append(fs, Finding{Severity: Info, Check: "nodes", What: "only meshcni redirects on " + nodeList(meshOnly)})
	}
	return fs
}

// multusFindings check that the network the injector names resolves to a plugin
// after the switch.
func multusFindings(injs []Injector, mesh *Install, nads []NetworkAttachment) []Finding {
	var fs []Finding
	for _, inj := range injs {
		if !inj.CNIEnabled {
			continue
		}
		if inj.CNIProvider != "multus" {
			if mesh != nil && mesh.Chained != nil && !*mesh.Chained {
				fs = append(fs, Finding{Severity: Blocker, Check: "multus",
					What: fmt.Sprintf("meshcni runs standalone (network %s, for Multus) but injector %s uses pilot.cni.provider=%s: its pods never ask for meshcni's network and start unredirected or fail istio-validation", mesh.NetworkName, inj.ConfigMap, inj.CNIProvider),
					Do:   "install meshcni chained (chained: true), or set pilot.cni.provider=multus on istiod where Multus runs"})
			}
			continue
		}
		fs = append(fs, networkFindings(inj, mesh, nads)...)
	}
	return fs
}

func networkFindings(inj Injector, mesh *Install, nads []NetworkAttachment) []Finding {
	if inj.MultusNetwork == "" {
		return []Finding{{Severity: Warning, Check: "multus",
			What: fmt.Sprintf("injector %s uses pilot.cni.provider=multus but its sidecar template appends no Multus network", inj.ConfigMap),
			Do:   "check the sidecar template of " + inj.ConfigMap}}
	}
	ns, name, ok := strings.Cut(inj.MultusNetwork, "/")
	if !ok {
		ns, name = "", inj.MultusNetwork
	}
	var fs []Finding
	if mesh != nil && mesh.Chained != nil {
		switch {
		case *mesh.Chained:
			fs = append(fs, Finding{Severity: Warning, Check: "multus",
				What: fmt.Sprintf("injector %s asks Multus for network %s but meshcni is chained into the primary network", inj.ConfigMap, inj.MultusNetwork),
				Do:   "install meshcni standalone (chained: false) with network name " + name + ", as Istio's istio-cni runs under Multus"})
		case mesh.NetworkName != name:
			fs = append(fs, Finding{Severity: Blocker, Check: "multus",
				What: fmt.Sprintf("injector %s writes Multus network %s, meshcni's standalone network is %s: once istio-cni is gone, injected pods name a network no plugin answers", inj.ConfigMap, inj.MultusNetwork, mesh.NetworkName),
				Do:   "give meshcni the network name " + name + " (the injector's), or change the injector's template to " + mesh.NetworkName})
		}
	}
	if nads == nil {
		return append(fs, Finding{Severity: Warning, Check: "multus",
			What: fmt.Sprintf("injector %s asks Multus for network %s but the API server serves no NetworkAttachmentDefinitions (Multus is not installed)", inj.ConfigMap, inj.MultusNetwork),
			Do:   "set pilot.cni.provider=default unless Multus runs on the nodes"})
	}
	nad := findNAD(nads, ns, name)
	switch {
	case nad == nil:
		fs = append(fs, Finding{Severity: Blocker, Check: "multus",
			What: fmt.Sprintf("injected pods name Multus network %s but no NetworkAttachmentDefinition %s exists: Multus refuses to start them", inj.MultusNetwork, inj.MultusNetwork),
			Do:   "create NetworkAttachmentDefinition " + name + " in namespace " + ns + " (as Istio's chart does, without spec.config) for meshcni's standalone network"})
	case nad.Labels["operator.istio.io/component"] == "Cni" || nad.Labels["app.kubernetes.io/name"] == "istio-cni":
		fs = append(fs, Finding{Severity: Warning, Check: "multus",
			What: fmt.Sprintf("NetworkAttachmentDefinition %s belongs to Istio's istio-cni chart: uninstalling that chart deletes it, and pods injected with it stop starting", inj.MultusNetwork),
			Do:   "have meshcni's installation own a NetworkAttachmentDefinition " + inj.MultusNetwork + " before uninstalling istio-cni"})
	}
	return fs
}

func findNAD(nads []NetworkAttachment, ns, name string) *NetworkAttachment {
	for i := range nads {
		if nads[i].Name == name && (ns == "" || nads[i].Namespace == ns) {
			return &nads[i]
		}
	}
	return nil
}

func sortedKeys(m map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// maxListed names at most this many nodes or pods in a finding.
const maxListed = 8

func nodeList(nodes []string) string {
	if len(nodes) == 0 {
		return "no node"
	}
	word := "node "
	if len(nodes) > 1 {
		word = "nodes "
	}
	return word + listOr(nodes, "")
}

func listOr(items []string, none string) string {
	if len(items) == 0 {
		return none
	}
	if len(items) > maxListed {
		return strings.Join(items[:maxListed], ", ") + fmt.Sprintf(" and %d more", len(items)-maxListed)
	}
	return strings.Join(items, ", ")
}
