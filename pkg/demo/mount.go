package demo

import (
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/pkg/testbed"
)

// shareRunDir makes the test bed's tmpfs (which holds containerd's pod netns files,
// testbed.NetnsDir) a shared mount. The agent mounts the netns directory with
// mountPropagation HostToContainer (repair in place), which the kubelet accepts only
// from a shared or slave mount; on a host whose / is private (this CI VM: no systemd)
// the tmpfs is private too. Idempotent; nothing else mounts under it.
func shareRunDir() error {
	if err := unix.Mount("", testbed.RunDir, "", unix.MS_SHARED|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("make %s a shared mount (for the agent's HostToContainer netns mount): %w", testbed.RunDir, err)
	}
	return nil
}
