// Command demo shows meshcni's redirect on this machine, without Kubernetes: it
// makes a pod-like network namespace wired to a peer, runs the stand-in sidecar
// proxy (meshcni-proxysim) as UID 1337 inside it, applies meshcni's rules with the
// engine, and connects out and in as an application UID and as the proxy UID. It
// prints what the proxy saw, with the original destinations, and exits non-zero if
// anything did not happen as shown. Run it as root: `make demo-netns` (`make demo` is
// the full demo on the test bed's Kubernetes, hack/demo).
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/spf13/pflag"
	"github.com/vishvananda/netlink"

	"github.com/meshcni/meshcni/internal/standin/proxysim"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/internal/testkit/traffic"
	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/engine"
	"github.com/meshcni/meshcni/pkg/flagenv"
	"github.com/meshcni/meshcni/pkg/netnsutil"
	"github.com/meshcni/meshcni/pkg/spec"
)

var (
	podIP  = netip.MustParseAddr("10.250.0.2")
	peerIP = netip.MustParseAddr("10.250.0.1")
)

func main() {
	fs := pflag.NewFlagSet("demo-netns", pflag.ExitOnError)
	bin := fs.String("bin", "bin", "directory holding meshcni-proxysim (make build)")
	be := fs.String("backend", "auto", "backend: auto, nftables, iptables-nft, iptables-legacy")
	_ = fs.Parse(flagenv.GoStyle(fs, os.Args[1:]))
	if err := run(*bin, *be); err != nil {
		fmt.Fprintf(os.Stderr, "demo: FAILED: %v\n", err)
		os.Exit(1)
	}
	fmt.Println("demo: OK — outbound and inbound connections of the app were captured by the proxy with their original destinations; the proxy's own traffic was not.")
}

func run(bin, be string) error {
	if os.Geteuid() != 0 {
		return errors.New("run as root (network namespaces and rules)")
	}
	kind, err := backend.ParseKind(be)
	if err != nil {
		return err
	}
	proxysimBin, err := filepath.Abs(filepath.Join(bin, "meshcni-proxysim"))
	if err != nil {
		return err
	}
	if _, err := os.Stat(proxysimBin); err != nil {
		return fmt.Errorf("%s missing: run `make build` first: %w", proxysimBin, err)
	}
	suffix := fmt.Sprint(os.Getpid())
	podNS, err := testutil.CreateNetns("meshcni-demo-pod-" + suffix)
	if err != nil {
		return err
	}
	defer testutil.DeleteNetns(podNS)
	peerNS, err := testutil.CreateNetns("meshcni-demo-peer-" + suffix)
	if err != nil {
		return err
	}
	defer testutil.DeleteNetns(peerNS)
	if err := wire(podNS, peerNS); err != nil {
		return fmt.Errorf("wire the namespaces: %w", err)
	}
	fmt.Printf("1. pod netns %s (eth0 %s) wired to peer netns %s (%s)\n", podNS, podIP, peerNS, peerIP)

	stopApps, err := startApp(peerNS, netip.AddrPortFrom(netip.IPv4Unspecified(), 8080), "peer-app")
	if err != nil {
		return err
	}
	defer stopApps()
	stopPodApp, err := startApp(podNS, netip.AddrPortFrom(netip.IPv4Unspecified(), 9080), "pod-app")
	if err != nil {
		return err
	}
	defer stopPodApp()

	records, stopProxy, err := startProxy(proxysimBin, podNS)
	if err != nil {
		return err
	}
	defer stopProxy()
	fmt.Println("2. meshcni-proxysim listening on 15001 (outbound) and 15006 (inbound) as UID 1337, forwarding to original destinations")

	s := spec.PodDefaults()
	start := time.Now()
	used, err := engine.Apply(context.Background(), engine.Options{Backend: kind, NetnsPath: podNS}, &s)
	if err != nil {
		return fmt.Errorf("apply rules: %w", err)
	}
	fmt.Printf("3. meshcni rules applied with %s in %s\n\n", used, time.Since(start).Round(time.Microsecond))

	type row struct {
		who, from   string
		dst         netip.AddrPort
		cred        traffic.Cred
		wantCapture bool
	}
	rows := []row{
		{"app (uid 1000) → peer", podNS, netip.AddrPortFrom(peerIP, 8080), traffic.Cred{UID: 1000, GID: 1000}, true},
		{"proxy (uid 1337) → peer", podNS, netip.AddrPortFrom(peerIP, 8080), traffic.ProxyCred, false},
		{"peer → pod app", peerNS, netip.AddrPortFrom(podIP, 9080), traffic.Cred{UID: 1000, GID: 1000}, true},
	}
	tw := tabwriter.NewWriter(os.Stdout, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "CONNECTION\tDESTINATION\tCAPTURED BY PROXY\tORIGINAL DST SEEN BY PROXY\tREPLY")
	var failures []string
	for _, r := range rows {
		before := len(records.all())
		out, err := traffic.RunInNetns(r.from, r.cred, 10*time.Second, proxysimBin, "client", "--connect", r.dst.String(), "--send", "hello")
		if err != nil {
			return fmt.Errorf("%s: %w", r.who, err)
		}
		var res proxysim.ProbeResult
		if err := json.Unmarshal(out, &res); err != nil {
			return fmt.Errorf("%s: decode %q: %w", r.who, out, err)
		}
		time.Sleep(100 * time.Millisecond)
		var rec *proxysim.Record
		for _, x := range records.all()[before:] {
			if x.Event == proxysim.EventConn && x.OrigDst == r.dst {
				rec = &x
			}
		}
		captured, orig := "no", "-"
		if rec != nil {
			captured, orig = rec.Listener+" ("+rec.Local.String()+")", rec.OrigDst.String()
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", r.who, r.dst, captured, orig, strings.TrimSpace(firstLine(res.Reply)))
		if (rec != nil) != r.wantCapture {
			failures = append(failures, fmt.Sprintf("%s: captured=%v, want %v", r.who, rec != nil, r.wantCapture))
		}
		if !res.Connected || !strings.Contains(res.Reply, "app") {
			failures = append(failures, fmt.Sprintf("%s: the app did not answer (%+v)", r.who, res))
		}
	}
	tw.Flush()

	live, err := engine.Live(context.Background(), engine.Options{Backend: used, NetnsPath: podNS})
	if err == nil {
		fmt.Printf("\n4. live meshcni rules in the pod netns (%s), first lines:\n", used)
		lines := strings.Split(strings.TrimSpace(live[used]), "\n")
		for i, l := range lines {
			if i == 12 {
				fmt.Printf("   ... %d more\n", len(lines)-i)
				break
			}
			fmt.Println("   " + l)
		}
	}
	if err := engine.Clean(context.Background(), engine.Options{NetnsPath: podNS}); err != nil {
		return fmt.Errorf("clean: %w", err)
	}
	fmt.Println("5. rules removed with engine.Clean; namespaces deleted on exit")
	if len(failures) > 0 {
		return errors.New(strings.Join(failures, "; "))
	}
	return nil
}

func firstLine(s string) string {
	l, _, _ := strings.Cut(s, "\n")
	return l
}

// wire creates eth0 in the pod namespace paired with eth0 in the peer namespace.
func wire(podNS, peerNS string) error {
	podH, err := os.Open(podNS)
	if err != nil {
		return err
	}
	defer podH.Close()
	peerH, err := os.Open(peerNS)
	if err != nil {
		return err
	}
	defer peerH.Close()
	veth := &netlink.Veth{
		LinkAttrs:     netlink.LinkAttrs{Name: "mcnidemo" + fmt.Sprint(os.Getpid()%10000), Namespace: netlink.NsFd(podH.Fd())},
		PeerName:      "eth0",
		PeerNamespace: netlink.NsFd(peerH.Fd()),
	}
	if err := netlink.LinkAdd(veth); err != nil {
		return fmt.Errorf("add veth: %w", err)
	}
	if err := netnsutil.Do(podNS, func() error { return setup(veth.Name, podIP) }); err != nil {
		return err
	}
	return netnsutil.Do(peerNS, func() error { return setup("eth0", peerIP) })
}

func setup(name string, ip netip.Addr) error {
	l, err := netlink.LinkByName(name)
	if err != nil {
		return err
	}
	if name != "eth0" {
		if err := netlink.LinkSetName(l, "eth0"); err != nil {
			return err
		}
	}
	if err := netlink.AddrAdd(l, &netlink.Addr{IPNet: &net.IPNet{IP: ip.AsSlice(), Mask: net.CIDRMask(24, 32)}}); err != nil {
		return err
	}
	return netlink.LinkSetUp(l)
}

// startApp serves "hello from NAME" on addr inside the namespace.
func startApp(nsPath string, addr netip.AddrPort, name string) (func(), error) {
	var ln net.Listener
	err := netnsutil.Do(nsPath, func() (err error) {
		ln, err = net.Listen("tcp", addr.String())
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("%s listen: %w", name, err)
	}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				_ = c.SetDeadline(time.Now().Add(5 * time.Second))
				_, _ = io.Copy(io.Discard, io.LimitReader(c, 1024))
				fmt.Fprintf(c, "hello from %s, I saw the connection come from %s\n", name, c.RemoteAddr())
			}()
		}
	}()
	return func() { ln.Close() }, nil
}

type recordLog struct {
	mu   sync.Mutex
	recs []proxysim.Record
}

func (r *recordLog) all() []proxysim.Record {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]proxysim.Record(nil), r.recs...)
}

func startProxy(bin, podNS string) (*recordLog, func(), error) {
	cmd := exec.Command(bin, "--mode=forward", "--inbound-source=127.0.0.6", "--ipv6=false")
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, nil, err
	}
	done, err := traffic.StartInNetns(podNS, traffic.ProxyCred, cmd)
	if err != nil {
		return nil, nil, fmt.Errorf("start proxy: %w", err)
	}
	log := &recordLog{}
	ready := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(stdout)
		once := sync.Once{}
		for sc.Scan() {
			var r proxysim.Record
			if json.Unmarshal(sc.Bytes(), &r) != nil {
				continue
			}
			if r.Event == proxysim.EventReady {
				once.Do(func() { close(ready) })
			}
			log.mu.Lock()
			log.recs = append(log.recs, r)
			log.mu.Unlock()
		}
	}()
	stop := func() { _ = cmd.Process.Kill(); <-done }
	select {
	case <-ready:
	case err := <-done:
		return nil, nil, fmt.Errorf("proxy exited: %v", err)
	case <-time.After(10 * time.Second):
		stop()
		return nil, nil, errors.New("proxy not ready after 10s")
	}
	return log, stop, nil
}
