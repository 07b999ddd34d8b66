// Package k8spod converts k8s.io/api's v1 Pod into capture.Pod, for the callers that
// hold corev1 pods (the agent's cache and repair controller, meshcnictl, tests). The
// CNI plugin never links it: it decodes the API server's JSON into capture.Pod
// directly and so stays free of k8s.io packages.
package k8spod

import (
	corev1 "k8s.io/api/core/v1"

	"github.com/meshcni/meshcni/pkg/capture"
)

// From returns the fields of pod that package capture reads (nil for nil). The result shares
// no memory with pod except its label and annotation maps, which capture only reads.
func From(pod *corev1.Pod) *capture.Pod {
	if pod == nil {
		return nil
	}
	p := &capture.Pod{
		ObjectMeta: capture.ObjectMeta{
			Namespace:   pod.Namespace,
			Name:        pod.Name,
			UID:         string(pod.UID),
			Labels:      pod.Labels,
			Annotations: pod.Annotations,
		},
		Spec: capture.PodSpec{
			InitContainers: containers(pod.Spec.InitContainers),
			Containers:     containers(pod.Spec.Containers),
			NodeName:       pod.Spec.NodeName,
			HostNetwork:    pod.Spec.HostNetwork,
		},
		Status: capture.PodStatus{
			Phase: string(pod.Status.Phase),
			PodIP: pod.Status.PodIP,
		},
	}
	if len(pod.Status.PodIPs) > 0 {
		p.Status.PodIPs = make([]capture.PodIP, len(pod.Status.PodIPs))
		for i, ip := range pod.Status.PodIPs {
			p.Status.PodIPs[i] = capture.PodIP{IP: ip.IP}
		}
	}
	return p
}

func containers(cs []corev1.Container) []capture.Container {
	if len(cs) == 0 {
		return nil
	}
	out := make([]capture.Container, len(cs))
	for i := range cs {
		c := &cs[i]
		o := capture.Container{Name: c.Name, Image: c.Image}
		if len(c.Args) > 0 {
			o.Args = append([]string(nil), c.Args...)
		}
		if c.RestartPolicy != nil {
			rp := string(*c.RestartPolicy)
			o.RestartPolicy = &rp
		}
		if sc := c.SecurityContext; sc != nil {
			o.SecurityContext = &capture.SecurityContext{RunAsUser: copyInt(sc.RunAsUser), RunAsGroup: copyInt(sc.RunAsGroup)}
		}
		if len(c.Env) > 0 {
			o.Env = make([]capture.EnvVar, len(c.Env))
			for j, e := range c.Env {
				o.Env[j] = capture.EnvVar{Name: e.Name, Value: e.Value}
				if e.ValueFrom != nil {
					o.Env[j].ValueFrom = &capture.EnvVarSource{}
				}
			}
		}
		out[i] = o
	}
	return out
}

func copyInt(p *int64) *int64 {
	if p == nil {
		return nil
	}
	v := *p
	return &v
}
