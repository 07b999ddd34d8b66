package testbed

import (
	"os/exec"
	"strings"
)

// portmapRules are the top-level hooks the portmap plugin installs on first use and
// never removes (it only removes its per-pod chains on CNI DEL).
var portmapRules = [][]string{
	{"-t", "nat", "-D", "PREROUTING", "-m", "addrtype", "--dst-type", "LOCAL", "-j", "CNI-HOSTPORT-DNAT"},
	{"-t", "nat", "-D", "OUTPUT", "-m", "addrtype", "--dst-type", "LOCAL", "-j", "CNI-HOSTPORT-DNAT"},
	{"-t", "nat", "-D", "POSTROUTING", "-m", "comment", "--comment", "CNI portfwd requiring masquerade", "-j", "CNI-HOSTPORT-MASQ"},
}

var portmapChains = []string{"CNI-HOSTPORT-DNAT", "CNI-HOSTPORT-MASQ", "CNI-HOSTPORT-SETMARK"}

// portmapChainsPresent reports whether portmap's top-level chains exist in the
// host's nat table, and whether any pod mapping still uses them.
func portmapChainsPresent() (present, inUse bool) {
	out, err := exec.Command("iptables", "-w", "-t", "nat", "-S", "CNI-HOSTPORT-DNAT").Output()
	if err != nil {
		return false, false
	}
	for _, l := range strings.Split(string(out), "\n") {
		if strings.HasPrefix(l, "-A CNI-HOSTPORT-DNAT") {
			return true, true
		}
	}
	return true, false
}

// removePortmapChains deletes portmap's top-level chains from the host when no pod
// mapping uses them any more (the test bed is the only CNI user it knows of).
func removePortmapChains() {
	present, inUse := portmapChainsPresent()
	if !present || inUse {
		return
	}
	for _, r := range portmapRules {
		for range 5 { // a rule may have been added more than once
			if exec.Command("iptables", append([]string{"-w"}, r...)...).Run() != nil {
				break
			}
		}
	}
	for _, c := range portmapChains {
		_ = exec.Command("iptables", "-w", "-t", "nat", "-F", c).Run()
	}
	for _, c := range portmapChains {
		_ = exec.Command("iptables", "-w", "-t", "nat", "-X", c).Run()
	}
}
