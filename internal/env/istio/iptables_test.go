package istio

import (
	"os"
	"path"
	"testing"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
)

// TestIptablesFiles: the proxyv2 image gets every command pilot-agent's
// istio-iptables may run, the REDIRECT and owner extensions, the dynamic loader and
// the libraries, each from an existing host file.
func TestIptablesFiles(t *testing.T) {
	testutil.RequireBinary(t, "iptables")
	files, err := IptablesFiles()
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"/usr/sbin/iptables-nft-save", "/usr/sbin/iptables-nft-restore", "/usr/sbin/ip6tables-nft",
		"/usr/sbin/iptables-legacy-save", "/usr/sbin/iptables-restore", "/usr/sbin/ip6tables-restore",
		path.Join(XtablesLibDir, "libxt_REDIRECT.so"), path.Join(XtablesLibDir, "libxt_owner.so"),
		"/lib64/ld-linux-x86-64.so.2", "/lib/x86_64-linux-gnu/libc.so.6", "/lib/x86_64-linux-gnu/libxtables.so.12",
	} {
		if _, ok := files[want]; !ok {
			t.Errorf("no %s in the image", want)
		}
	}
	for dst, src := range files {
		if st, err := os.Stat(src); err != nil || !st.Mode().IsRegular() {
			t.Errorf("%s from %s: %v", dst, src, err)
		}
	}
}
