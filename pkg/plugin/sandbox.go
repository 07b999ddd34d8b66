package plugin

import (
	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/pkg/agentsock"
	"github.com/meshcni/meshcni/pkg/netnsutil"
)

// decided notes what the ADD decided about the pod, for the agent's record of the
// sandbox (sandboxReport).
func (inv *invocation) decided(decision, reason string) {
	inv.decision, inv.reason = decision, reason
}

// sandboxReport is what a successful ADD tells the agent of the sandbox: the
// decision and the identity of CNI_NETNS (its file's device and inode, its
// cookie). nil when no agent listens or the ADD decided nothing (not a Kubernetes
// pod). An unreadable identity is sent as zeros: the agent then has no netns to
// trust for the sandbox and acts on none.
func (inv *invocation) sandboxReport() *agentsock.Sandbox {
	if inv.sock == nil || inv.decision == "" {
		return nil
	}
	sb := &agentsock.Sandbox{PodUID: inv.uid, Decision: inv.decision, Reason: inv.reason, Netns: inv.args.Netns}
	var st unix.Stat_t
	if inv.args.Netns != "" && unix.Stat(inv.args.Netns, &st) == nil {
		sb.NetnsDev, sb.NetnsInode = uint64(st.Dev), st.Ino
		sb.NetnsCookie, _ = inv.cookie()
	}
	return sb
}

// cookie is CNI_NETNS's cookie, read once per invocation.
func (inv *invocation) cookie() (uint64, error) {
	if !inv.cookieRead {
		inv.cookieRead = true
		inv.netnsCookie, inv.cookieErr = netnsutil.Cookie(inv.args.Netns)
	}
	return inv.netnsCookie, inv.cookieErr
}
