package capture

// Pod holds the fields of a Kubernetes v1 Pod that meshcni reads, and nothing else.
// Its JSON tags are the Kubernetes API's, so the API server's JSON for a Pod decodes
// into it directly (unknown fields are skipped). The CNI plugin decodes into it
// instead of k8s.io/api's v1.Pod: the plugin, which runs once per pod sandbox, then
// links no k8s.io package (whose size and package init every exec would pay) and
// decodes only the fields it reads (docs/performance.md).
// Callers holding a *corev1.Pod convert it with package capture/k8spod.
type Pod struct {
	ObjectMeta `json:"metadata"`
	Spec       PodSpec   `json:"spec"`
	Status     PodStatus `json:"status"`
}

// ObjectMeta is the part of the pod's metadata meshcni reads.
type ObjectMeta struct {
	Namespace   string            `json:"namespace,omitempty"`
	Name        string            `json:"name,omitempty"`
	UID         string            `json:"uid,omitempty"`
	Labels      map[string]string `json:"labels,omitempty"`
	Annotations map[string]string `json:"annotations,omitempty"`
}

// PodSpec is the part of the pod's spec meshcni reads.
type PodSpec struct {
	InitContainers []Container `json:"initContainers,omitempty"`
	Containers     []Container `json:"containers,omitempty"`
	NodeName       string      `json:"nodeName,omitempty"`
	HostNetwork    bool        `json:"hostNetwork,omitempty"`
}

// ContainerRestartPolicyAlways makes an init container a native sidecar.
const ContainerRestartPolicyAlways = "Always"

// Container is the part of a container meshcni reads.
type Container struct {
	Name            string           `json:"name"`
	Image           string           `json:"image,omitempty"`
	Args            []string         `json:"args,omitempty"`
	Env             []EnvVar         `json:"env,omitempty"`
	RestartPolicy   *string          `json:"restartPolicy,omitempty"`
	SecurityContext *SecurityContext `json:"securityContext,omitempty"`
}

// EnvVar is a container environment variable. Only a literal Value is usable here;
// a valueFrom source cannot be resolved by meshcni, so only its presence is kept.
type EnvVar struct {
	Name      string        `json:"name"`
	Value     string        `json:"value,omitempty"`
	ValueFrom *EnvVarSource `json:"valueFrom,omitempty"`
}

// EnvVarSource marks an environment variable whose value comes from elsewhere
// (its content is not kept).
type EnvVarSource struct{}

// SecurityContext is the part of a container's securityContext meshcni reads.
type SecurityContext struct {
	RunAsUser  *int64 `json:"runAsUser,omitempty"`
	RunAsGroup *int64 `json:"runAsGroup,omitempty"`
}

// PodStatus is the part of the pod's status meshcni reads.
type PodStatus struct {
	Phase  string  `json:"phase,omitempty"`
	PodIP  string  `json:"podIP,omitempty"`
	PodIPs []PodIP `json:"podIPs,omitempty"`
}

// PodIP is one of the pod's addresses.
type PodIP struct {
	IP string `json:"ip"`
}
