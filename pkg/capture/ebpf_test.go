package capture

import "testing"

// TestBuildAcceleration: the pod's meshcni.io/ebpf-acceleration lands in
// Result.EBPF, parsed; without it the agent's default applies.
func TestBuildAcceleration(t *testing.T) {
	for _, tt := range []struct {
		pod  *Pod
		want Acceleration
		on   bool
	}{
		{meshedPod(), AccelDefault, false},
		{meshedPod(ann(AnnotationEBPFAcceleration, "off")), AccelOff, false},
		{meshedPod(ann(AnnotationEBPFAcceleration, "to-proxy")), AccelToProxy, true},
		{meshedPod(ann(AnnotationEBPFAcceleration, " Both ")), AccelBoth, true},
	} {
		res, err := Build(tt.pod)
		if err != nil {
			t.Fatalf("%v: %v", tt.pod.Annotations, err)
		}
		if res.EBPF != tt.want || res.EBPF.On() != tt.on {
			t.Errorf("%v: EBPF %q (on %v), want %q (on %v)", tt.pod.Annotations, res.EBPF, res.EBPF.On(), tt.want, tt.on)
		}
	}
}
