// Package precheck judges, from the cluster's objects, whether a switch from Istio's
// istio-cni to meshcni (or back) can leave a pod unredirected: which CNI runs on
// which node, what istiod's injector renders, which meshed pods lack the validation
// init container. It only reads objects it is given: meshcnictl precheck lists them
// from the API server.
package precheck

import (
	"fmt"
	"sort"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
)

// Severity of a finding.
type Severity string

// Severities, the gravest first.
const (
	// Blocker: a pod would start unredirected, or not start, if the switch went on.
	Blocker Severity = "blocker"
	// Warning: something to fix or to know before the switch; no pod is at risk yet.
	Warning Severity = "warning"
	// Info: what is installed where.
	Info Severity = "info"
)

var rank = map[Severity]int{Blocker: 0, Warning: 1, Info: 2}

// Finding is one line of the precheck: its severity, what is true, what to do.
type Finding struct {
	Severity Severity `json:"severity"`
	// Check names the check that found it (stable, for scripts).
	Check string `json:"check"`
	What  string `json:"what"`
	// Do is what to do ("" for a plain fact).
	Do string `json:"do,omitempty"`
}

func (f Finding) String() string {
	s := fmt.Sprintf("%-7s  %s", strings.ToUpper(string(f.Severity)), f.What)
	if f.Do != "" {
		s += "  => " + f.Do
	}
	return s
}

// NetworkAttachment is a Multus NetworkAttachmentDefinition, as far as precheck reads it.
type NetworkAttachment struct {
	Namespace string
	Name      string
	Labels    map[string]string
	// Config is spec.config ("" when Multus reads the network from its directory by name).
	Config string
}

// Input is the cluster's state that precheck judges.
type Input struct {
	Nodes      []corev1.Node
	DaemonSets []appsv1.DaemonSet
	// Pods of every namespace.
	Pods []corev1.Pod
	// InjectorConfigMaps are istiod's istio-sidecar-injector[-REVISION] ConfigMaps.
	InjectorConfigMaps []corev1.ConfigMap
	// NetworkAttachments is nil when the API server does not serve Multus'
	// NetworkAttachmentDefinitions.
	NetworkAttachments []NetworkAttachment
}

// Result is the findings, the gravest first, and what they were judged from.
type Result struct {
	Findings  []Finding  `json:"findings"`
	Injectors []Injector `json:"injectors"`
	IstioCNI  *Install   `json:"istioCNI,omitempty"`
	Meshcni   *Install   `json:"meshcni,omitempty"`
	Blockers  int        `json:"blockers"`
	Warnings  int        `json:"warnings"`
}

// Run judges the input.
func Run(in Input) Result {
	r := Result{}
	add := func(fs ...Finding) { r.Findings = append(r.Findings, fs...) }
	var injFindings []Finding
	r.Injectors, injFindings = injectors(in.InjectorConfigMaps)
	r.IstioCNI, r.Meshcni = findInstall(in, istioCNI), findInstall(in, meshcni)
	add(installFindings(r.IstioCNI, istioCNI)...)
	add(installFindings(r.Meshcni, meshcni)...)
	add(injFindings...)
	add(nodeFindings(in.Nodes, r.Injectors, r.IstioCNI, r.Meshcni)...)
	add(multusFindings(r.Injectors, r.Meshcni, in.NetworkAttachments)...)
	add(podFindings(in.Pods)...)
	sort.SliceStable(r.Findings, func(i, j int) bool { return rank[r.Findings[i].Severity] < rank[r.Findings[j].Severity] })
	for _, f := range r.Findings {
		switch f.Severity {
		case Blocker:
			r.Blockers++
		case Warning:
			r.Warnings++
		}
	}
	return r
}

func injectors(cms []corev1.ConfigMap) ([]Injector, []Finding) {
	var out []Injector
	var fs []Finding
	for i := range cms {
		inj, err := ParseInjector(&cms[i])
		if err != nil {
			fs = append(fs, Finding{Severity: Warning, Check: "injector", What: err.Error(),
				Do: "check istiod's installation: the injector reads the same ConfigMap"})
			continue
		}
		out = append(out, inj)
		fs = append(fs, injectorFinding(inj))
	}
	if len(cms) == 0 {
		fs = append(fs, Finding{Severity: Warning, Check: "injector",
			What: "no istio-sidecar-injector ConfigMap: istiod's injector is not installed, nothing says what new pods get",
			Do:   "install istiod with pilot.cni.enabled=true before meshing pods"})
	}
	return out, fs
}

func injectorFinding(inj Injector) Finding {
	what := fmt.Sprintf("injector %s (revision %s): pilot.cni.enabled=%v, pilot.cni.provider=%s, proxy-init image %s",
		inj.ConfigMap, inj.Revision, inj.CNIEnabled, inj.CNIProvider, inj.ProxyInitImage)
	if inj.MultusNetwork != "" {
		what += ", Multus network " + inj.MultusNetwork
	}
	if inj.CNIEnabled {
		return Finding{Severity: Info, Check: "injector", What: what + ": new pods get istio-validation and rely on the CNI plugin"}
	}
	return Finding{Severity: Blocker, Check: "injector",
		What: what + ": new pods get the privileged istio-init, not the CNI redirect",
		Do:   "set pilot.cni.enabled=true on istiod (Helm: --set pilot.cni.enabled=true on the istiod release; istioctl sets it from components.cni.enabled, see docs/migration.md) and restart the meshed workloads"}
}
