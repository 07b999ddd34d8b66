package precheck

import (
	"encoding/json"
	"fmt"
	"regexp"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

// InjectorConfigMap is the name of istiod's injector ConfigMap; a revision's is
// InjectorConfigMap + "-" + revision (Istio's istio-discovery chart).
const InjectorConfigMap = "istio-sidecar-injector"

// Injector is what one of istiod's injector ConfigMaps makes the injector render.
type Injector struct {
	// ConfigMap is namespace/name.
	ConfigMap string `json:"configMap"`
	Revision  string `json:"revision"`
	// CNIEnabled is pilot.cni.enabled: true, pods get the istio-validation init
	// container and rely on a CNI plugin; false, they get the privileged istio-init.
	CNIEnabled bool `json:"cniEnabled"`
	// CNIProvider is pilot.cni.provider ("default" or "multus").
	CNIProvider string `json:"cniProvider"`
	// MultusNetwork is the namespace/name the sidecar template appends to
	// k8s.v1.cni.cncf.io/networks when the provider is multus ("" otherwise).
	MultusNetwork string `json:"multusNetwork,omitempty"`
	// ProxyInitImage is the image of istio-init / istio-validation.
	ProxyInitImage string `json:"proxyInitImage"`
}

// injectorValues is the part of the ConfigMap's "values" (JSON) the injector's
// sidecar template reads for the CNI and the init container.
type injectorValues struct {
	Revision string `json:"revision"`
	Pilot    struct {
		CNI struct {
			Enabled  bool   `json:"enabled"`
			Provider string `json:"provider"`
		} `json:"cni"`
	} `json:"pilot"`
	Global struct {
		Hub       string `json:"hub"`
		Tag       any    `json:"tag"`
		Variant   string `json:"variant"`
		ProxyInit struct {
			Image string `json:"image"`
		} `json:"proxy_init"`
	} `json:"global"`
}

// multusNetworkRE finds the network the sidecar template appends:
// appendMultusNetwork (index .ObjectMeta.Annotations `k8s.v1.cni.cncf.io/networks`) `default/istio-cni`.
var multusNetworkRE = regexp.MustCompile("appendMultusNetwork\\s*\\(.*?\\)\\s*[`\"]([^`\"]+)[`\"]")

// DefaultMultusNetwork is the network Istio's stock sidecar template names.
const DefaultMultusNetwork = "default/istio-cni"

// IsInjectorConfigMap reports whether a ConfigMap's name is an injector's.
func IsInjectorConfigMap(name string) bool {
	return name == InjectorConfigMap || strings.HasPrefix(name, InjectorConfigMap+"-")
}

// ParseInjector reads an injector ConfigMap as the injector does: "values" (JSON)
// and the "sidecar" template of "config" (YAML).
func ParseInjector(cm *corev1.ConfigMap) (Injector, error) {
	id := cm.Namespace + "/" + cm.Name
	inj := Injector{ConfigMap: id}
	raw, ok := cm.Data["values"]
	if !ok {
		return inj, fmt.Errorf("injector ConfigMap %s: no \"values\" key", id)
	}
	var v injectorValues
	if err := json.Unmarshal([]byte(raw), &v); err != nil {
		return inj, fmt.Errorf("injector ConfigMap %s: values: %w", id, err)
	}
	inj.Revision = v.Revision
	if inj.Revision == "" {
		inj.Revision = "default"
	}
	inj.CNIEnabled, inj.CNIProvider = v.Pilot.CNI.Enabled, v.Pilot.CNI.Provider
	if inj.CNIProvider == "" {
		inj.CNIProvider = "default"
	}
	inj.ProxyInitImage = proxyInitImage(v)
	if inj.CNIEnabled && inj.CNIProvider == "multus" {
		net, err := multusNetwork(cm.Data["config"])
		if err != nil {
			return inj, fmt.Errorf("injector ConfigMap %s: %w", id, err)
		}
		inj.MultusNetwork = net
	}
	return inj, nil
}

// multusNetwork is the network the "sidecar" template of the injector's config
// appends to the pod's Multus annotation (Istio's default when the template names
// none: a template that does not append one is reported as such).
func multusNetwork(config string) (string, error) {
	var c struct {
		Templates map[string]string `json:"templates"`
	}
	if err := yaml.Unmarshal([]byte(config), &c); err != nil {
		return "", fmt.Errorf("config: %w", err)
	}
	tpl, ok := c.Templates["sidecar"]
	if !ok {
		return DefaultMultusNetwork, nil
	}
	m := multusNetworkRE.FindStringSubmatch(tpl)
	if m == nil {
		return "", nil
	}
	return m[1], nil
}

// proxyInitImage is the init container's image as Istio's injector builds it
// (inject.ProxyInitImage): global.proxy_init.image when it holds a "/", else
// {hub}/{image}:{tag}, the tag carrying the variant.
func proxyInitImage(v injectorValues) string {
	name := v.Global.ProxyInit.Image
	if name == "" {
		name = "proxyv2"
	}
	if strings.Contains(name, "/") {
		return name
	}
	tag := ""
	if v.Global.Tag != nil {
		tag = fmt.Sprint(v.Global.Tag)
	}
	if vr := v.Global.Variant; vr != "" {
		for _, known := range []string{"distroless", "debug"} {
			tag = strings.TrimSuffix(tag, "-"+known)
		}
		if vr != "default" {
			tag += "-" + vr
		}
	}
	return v.Global.Hub + "/" + name + ":" + tag
}
