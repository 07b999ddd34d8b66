package plugin

import (
	"github.com/meshcni/meshcni/pkg/agentsock"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/spec"
)

// ebpfReport is what the agent needs to accelerate a meshed pod (pkg/agent/ebpf.go):
// its netns cookie, its annotation and its proxy's UID. nil when the pod's
// annotation says off, when no agent listens (nobody would use it), or when the
// cookie cannot be read (the kernel is older than 5.14: no acceleration either);
// the pod's redirect does not depend on it.
func (inv *invocation) ebpfReport(a capture.Acceleration, s *spec.Spec) *agentsock.PodEBPF {
	if a == capture.AccelOff || inv.sock == nil {
		return nil
	}
	cookie, err := inv.cookie()
	if err != nil {
		inv.log.Debug("no eBPF acceleration for the pod", "err", err)
		return nil
	}
	uid := spec.DefaultProxyUID
	if len(s.ProxyUIDs) > 0 {
		uid = s.ProxyUIDs[0]
	}
	return &agentsock.PodEBPF{NetnsCookie: cookie, Mode: string(a), ProxyUID: uid, PodUID: inv.uid}
}
