package plugin

import (
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/pkg/agentsock"
	"github.com/meshcni/meshcni/pkg/netnsutil"
	"github.com/meshcni/meshcni/pkg/podspec"
	"github.com/meshcni/meshcni/pkg/spec"
)

// ebpfReport is what the agent needs to accelerate a meshed pod (pkg/agent/ebpf.go):
// its netns cookie, its annotation and its proxy's UID. nil when the pod's
// annotation says off, when no agent listens (nobody would use it), or when the
// cookie cannot be read (the kernel is older than 5.14: no acceleration either);
// the pod's redirect does not depend on it.
func (inv *invocation) ebpfReport(a podspec.Acceleration, s *spec.Spec) *agentsock.PodEBPF {
	if a == podspec.AccelOff || inv.sock == nil {
		return nil
	}
	cookie, err := netnsCookie(inv.args.Netns)
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

// netnsCookie is the cookie of the network namespace at path, read with
// SO_NETNS_COOKIE from a socket opened inside it (Linux 5.14). A raw getsockopt:
// the plugin links no eBPF library (deps_test.go).
func netnsCookie(path string) (uint64, error) {
	var cookie uint64
	err := netnsutil.Do(path, func() error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("socket: %w", err)
		}
		defer unix.Close(fd)
		if cookie, err = unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_NETNS_COOKIE); err != nil {
			return fmt.Errorf("SO_NETNS_COOKIE (Linux 5.14): %w", err)
		}
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("netns cookie of %s: %w", path, err)
	}
	return cookie, nil
}
