package origdst_test

import (
	"errors"
	"net"
	"net/netip"
	"os/exec"
	"strconv"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/netnsutil"
	"github.com/meshcni/meshcni/pkg/origdst"
)

// inNetns runs fn on a thread inside the namespace at path.
func inNetns(t *testing.T, path string, fn func() error) {
	t.Helper()
	if err := netnsutil.Do(path, fn); err != nil {
		t.Fatal(err)
	}
}

// iptables runs one iptables-nft command inside the namespace (test rules only).
func iptables(t *testing.T, path, bin string, args ...string) {
	t.Helper()
	inNetns(t, path, func() error {
		out, err := exec.Command(bin, args...).CombinedOutput()
		if err != nil {
			t.Fatalf("%s %v: %v: %s", bin, args, err, out)
		}
		return nil
	})
}

// setupNetns makes a namespace with a veth pair (the kernel may lack the dummy driver),
// one end holding 192.0.2.1/24 and 2001:db8::1/64, so 192.0.2.99 and 2001:db8::99 route
// out of it (and get redirected).
func setupNetns(t *testing.T) string {
	t.Helper()
	path := testutil.NewNetns(t)
	inNetns(t, path, func() error {
		d := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "veth0"}, PeerName: "veth1"}
		if err := netlink.LinkAdd(d); err != nil {
			return err
		}
		if err := testutil.LinkUp("veth1"); err != nil {
			return err
		}
		for _, a := range []string{"192.0.2.1/24", "2001:db8::1/64"} {
			addr, err := netlink.ParseAddr(a)
			if err != nil {
				return err
			}
			addr.Flags = 0x02 // IFA_F_NODAD
			if err := netlink.AddrAdd(d, addr); err != nil {
				return err
			}
		}
		return netlink.LinkSetUp(d)
	})
	return path
}

type accepted struct {
	conn *net.TCPConn
	err  error
}

func TestOriginalDestination(t *testing.T) {
	testutil.RequireRoot(t)
	ipt4 := testutil.RequireBinary(t, "iptables-nft")
	ipt6 := testutil.RequireBinary(t, "ip6tables-nft")

	tests := []struct {
		name     string
		listen   string // listener address, port 0 = ephemeral
		dial     string // address the client dials
		redirect bool   // install a REDIRECT rule for dial → listener
		tproxy   bool   // read with Of(conn, true)
		want     func(listener netip.AddrPort) netip.AddrPort
	}{
		{
			name: "ipv4 redirect", listen: "127.0.0.1:0", dial: "192.0.2.99:80", redirect: true,
			want: func(netip.AddrPort) netip.AddrPort { return netip.MustParseAddrPort("192.0.2.99:80") },
		},
		{
			name: "ipv4 redirect to dual-stack listener", listen: "[::]:0", dial: "192.0.2.99:8080", redirect: true,
			want: func(netip.AddrPort) netip.AddrPort { return netip.MustParseAddrPort("192.0.2.99:8080") },
		},
		{
			name: "ipv6 redirect", listen: "[::1]:0", dial: "[2001:db8::99]:443", redirect: true,
			want: func(netip.AddrPort) netip.AddrPort { return netip.MustParseAddrPort("[2001:db8::99]:443") },
		},
		{
			name: "tproxy uses the local address", listen: "127.0.0.1:0", dial: "", tproxy: true,
			want: func(l netip.AddrPort) netip.AddrPort { return l },
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			path := setupNetns(t)
			var ln *net.TCPListener
			inNetns(t, path, func() error {
				l, err := net.Listen("tcp", tc.listen)
				if err != nil {
					return err
				}
				ln = l.(*net.TCPListener)
				return nil
			})
			defer ln.Close()
			lport := ln.Addr().(*net.TCPAddr).AddrPort().Port()
			laddr := netip.MustParseAddrPort(tc.listen)
			dial := tc.dial
			if dial == "" {
				dial = netip.AddrPortFrom(laddr.Addr(), lport).String()
			}
			dst := netip.MustParseAddrPort(dial)
			if tc.redirect {
				bin := ipt4
				if dst.Addr().Is6() {
					bin = ipt6
				}
				iptables(t, path, bin, "-t", "nat", "-A", "OUTPUT", "-p", "tcp",
					"-d", dst.Addr().String(), "--dport", strconv.Itoa(int(dst.Port())),
					"-j", "REDIRECT", "--to-ports", strconv.Itoa(int(lport)))
			}

			acc := make(chan accepted, 1)
			go func() {
				_ = ln.SetDeadline(time.Now().Add(5 * time.Second))
				c, err := ln.AcceptTCP()
				acc <- accepted{c, err}
			}()
			var client net.Conn
			inNetns(t, path, func() error {
				c, err := net.DialTimeout("tcp", dial, 3*time.Second)
				client = c
				return err
			})
			defer client.Close()
			a := <-acc
			if a.err != nil {
				t.Fatalf("accept: %v", a.err)
			}
			defer a.conn.Close()

			got, err := origdst.Of(a.conn, tc.tproxy)
			if err != nil {
				t.Fatalf("Of: %v", err)
			}
			want := tc.want(netip.AddrPortFrom(laddr.Addr(), lport))
			if got != want {
				t.Fatalf("original destination = %v, want %v", got, want)
			}
		})
	}
}

// A connection that no rule touched either has no NAT record (ErrNotRedirected) or
// reports its own local address; it never invents another destination.
func TestNotRedirected(t *testing.T) {
	testutil.RequireRoot(t)
	path := setupNetns(t)
	var ln net.Listener
	inNetns(t, path, func() error {
		var err error
		ln, err = net.Listen("tcp", "127.0.0.1:0")
		return err
	})
	defer ln.Close()
	acc := make(chan accepted, 1)
	go func() {
		c, err := ln.(*net.TCPListener).AcceptTCP()
		acc <- accepted{c, err}
	}()
	var client net.Conn
	inNetns(t, path, func() error {
		var err error
		client, err = net.DialTimeout("tcp", ln.Addr().String(), 3*time.Second)
		return err
	})
	defer client.Close()
	a := <-acc
	if a.err != nil {
		t.Fatal(a.err)
	}
	defer a.conn.Close()
	got, err := origdst.Redirected(a.conn)
	switch {
	case err != nil && !errors.Is(err, origdst.ErrNotRedirected):
		t.Fatalf("unexpected error: %v", err)
	case err == nil && got != ln.Addr().(*net.TCPAddr).AddrPort():
		t.Fatalf("original destination %v for an untouched connection to %v", got, ln.Addr())
	}
}

func TestNil(t *testing.T) {
	if _, err := origdst.Of(nil, false); err == nil {
		t.Fatal("want error for nil conn")
	}
	if _, err := origdst.Of(nil, true); err == nil {
		t.Fatal("want error for nil conn")
	}
}
