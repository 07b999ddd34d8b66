package iptables

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// ToolDirs are the directories searched, in this order, for iptables-{legacy,nft}-save
// and -restore. PATH is never searched: the plugin runs with the container runtime's
// environment and the agent with its pod's, and neither may choose the program that
// runs as root in a pod's network namespace.
var ToolDirs = []string{"/usr/sbin", "/sbin", "/usr/bin", "/bin"}

// MaxOutput bounds what one run of an iptables tool may print on its standard output
// (16 MiB; meshcni's rules in a pod's namespace save to a few KiB). Past it the tool
// is killed and the operation fails before anything is restored.
const MaxOutput = 16 << 20

// lookTool returns the first dirs/name that is an executable regular file (symbolic
// links followed: /usr/sbin/iptables-nft-save links to xtables-nft-multi).
func lookTool(name string, dirs []string) (string, error) {
	for _, d := range dirs {
		p := filepath.Join(d, name)
		if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() && st.Mode().Perm()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s: no executable file of that name in %s (PATH is not searched)", name, strings.Join(dirs, ", "))
}
