// Package corepod converts k8s.io/api's v1 Pod into podspec.Pod, for the callers that
// hold corev1 pods (the agent's cache and repair controller, meshcnictl, tests). The
// CNI plugin never links it: it decodes the API server's JSON into podspec.Pod
// directly and so stays free of k8s.io packages.
package corepod

import (
	corev1 "k8s.io/api/core/v1"

	"github.com/meshcni/meshcni/pkg/podspec"
)

// From returns the fields of pod that podspec reads (nil for nil). The result shares
// no memory with pod except its label and annotation maps, which podspec only reads.
func From(pod *corev1.Pod) *podspec.Pod {
	if pod == nil {
		return nil
	}
	p := &podspec.Pod{
		ObjectMeta: podspec.ObjectMeta{
			Namespace:   pod.Namespace,
			Name:        pod.Name,
			UID:         string(pod.UID),
			Labels:      pod.Labels,
			Annotations: pod.Annotations,
		},
		Spec: podspec.PodSpec{
			InitContainers: containers(pod.Spec.InitContainers),
			Containers:     containers(pod.Spec.Containers),
			NodeName:       pod.Spec.NodeName,
			HostNetwork:    pod.Spec.HostNetwork,
		},
		Status: podspec.PodStatus{
			Phase: string(pod.Status.Phase),
			PodIP: pod.Status.PodIP,
		},
	}
	if len(pod.Status.PodIPs) > 0 {
		p.Status.PodIPs = make([]podspec.PodIP, len(pod.Status.PodIPs))
		for i, ip := range pod.Status.PodIPs {
			p.Status.PodIPs[i] = podspec.PodIP{IP: ip.IP}
		}
	}
	return p
}

func containers(cs []corev1.Container) []podspec.Container {
	if len(cs) == 0 {
		return nil
	}
	out := make([]podspec.Container, len(cs))
	for i := range cs {
		c := &cs[i]
		o := podspec.Container{Name: c.Name, Image: c.Image}
		if len(c.Args) > 0 {
			o.Args = append([]string(nil), c.Args...)
		}
		if c.RestartPolicy != nil {
			rp := string(*c.RestartPolicy)
			o.RestartPolicy = &rp
		}
		if sc := c.SecurityContext; sc != nil {
			o.SecurityContext = &podspec.SecurityContext{RunAsUser: copyInt(sc.RunAsUser), RunAsGroup: copyInt(sc.RunAsGroup)}
		}
		if len(c.Env) > 0 {
			o.Env = make([]podspec.EnvVar, len(c.Env))
			for j, e := range c.Env {
				o.Env[j] = podspec.EnvVar{Name: e.Name, Value: e.Value}
				if e.ValueFrom != nil {
					o.Env[j].ValueFrom = &podspec.EnvVarSource{}
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
