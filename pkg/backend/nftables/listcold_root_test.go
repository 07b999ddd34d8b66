package nftables_test

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	gnft "github.com/google/nftables"
	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/netlink"
	"github.com/meshcni/meshcni/pkg/netnsutil"
)

// coldListEnv makes the test binary a child that lists the tables of a namespace
// once, through the client its value names ("pkg-netlink:<netns>" or
// "google-nftables:<netns>"), prints how long that took (socket into the namespace,
// dump, close) in nanoseconds and exits: a fresh process, as the CNI plugin is.
const coldListEnv = "MESHCNI_NFT_COLD_LIST"

func TestMain(m *testing.M) {
	if v := os.Getenv(coldListEnv); v != "" {
		os.Exit(coldList(v))
	}
	os.Exit(m.Run())
}

// coldListers are the two netlink clients a table listing can go through.
var coldListers = map[string]func(netns string) (int, error){
	"pkg-netlink": func(netns string) (int, error) {
		c, err := netlink.OpenIn(netns, unix.NETLINK_NETFILTER)
		if err != nil {
			return 0, err
		}
		defer c.Close()
		ts, err := netlink.ListTables(c)
		return len(ts), err
	},
	"google-nftables": func(netns string) (int, error) {
		fd, err := netnsutil.Open(netns)
		if err != nil {
			return 0, err
		}
		defer unix.Close(fd)
		c, err := gnft.New(gnft.AsLasting(), gnft.WithNetNSFd(fd))
		if err != nil {
			return 0, err
		}
		defer func() { _ = c.CloseLasting() }()
		ts, err := c.ListTables()
		return len(ts), err
	},
}

func coldList(v string) int {
	name, netns, _ := strings.Cut(v, ":")
	list, ok := coldListers[name]
	if !ok {
		fmt.Fprintf(os.Stderr, "no lister %q\n", name)
		return 2
	}
	t0 := time.Now()
	n, err := list(netns)
	d := time.Since(t0)
	if err != nil || n == 0 {
		fmt.Fprintf(os.Stderr, "%s: %d tables, %v\n", name, n, err)
		return 1
	}
	fmt.Println(d.Nanoseconds())
	return 0
}

// BenchmarkListTablesCold compares the two netlink clients the product links on
// the one read both can do, a namespace's nftables table listing, in a fresh
// process each time: pkg/netlink (meshcni's) against google/nftables (over
// mdlayher/netlink). Per iteration each runs once (order alternating) against one
// namespace holding a table; the child times the listing alone. Reported:
// <client>-p50-µs; ns/op is the child processes and means little.
func BenchmarkListTablesCold(b *testing.B) {
	testutil.RequireRoot(b)
	self, err := os.Executable()
	if err != nil {
		b.Fatal(err)
	}
	ns := testutil.NewNetns(b)
	addForeignTable(b, ns, gnft.TableFamilyIPv4, "bench", "c")
	names := []string{"pkg-netlink", "google-nftables"}
	ds := map[string][]time.Duration{}
	for i := 0; b.Loop(); i++ {
		for j := range names {
			name := names[(i+j)%len(names)]
			cmd := exec.Command(self)
			cmd.Env = append(os.Environ(), coldListEnv+"="+name+":"+ns)
			var out, errb bytes.Buffer
			cmd.Stdout, cmd.Stderr = &out, &errb
			if err := cmd.Run(); err != nil {
				b.Fatalf("%s child: %v: %s", name, err, errb.Bytes())
			}
			d, err := strconv.ParseInt(string(bytes.TrimSpace(out.Bytes())), 10, 64)
			if err != nil {
				b.Fatalf("%s child output %q: %v", name, out.Bytes(), err)
			}
			ds[name] = append(ds[name], time.Duration(d))
		}
	}
	for _, name := range names {
		slices.Sort(ds[name])
		b.ReportMetric(float64(ds[name][len(ds[name])/2].Nanoseconds())/1000, name+"-p50-µs")
	}
}
