package demo

import (
	"bytes"
	"context"
	"errors"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/standin/proxysim"
	"github.com/meshcni/meshcni/internal/testkit/golden"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/internal/tools/build/image"
	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/capture/k8spod"
)

func TestMain(m *testing.M) { os.Exit(testbed.RunMain(m)) }

// TestPods: the plugin's own decision logic meshes the meshed pod only, with the
// proxy UID 1337, and no demo container asks for a capability.
func TestPods(t *testing.T) {
	const product, proxysim = "meshcni.local/meshcni:dev", "meshcni.local/meshcni-proxysim:dev"
	pods := Pods(product, proxysim)
	want := map[string]bool{MeshedPod: true, PlainPod: false, ServerPod: false}
	if len(pods) != len(want) {
		t.Fatalf("%d pods", len(pods))
	}
	for _, p := range pods {
		if p.Namespace != Namespace {
			t.Errorf("%s: namespace %q", p.Name, p.Namespace)
		}
		d := capture.Decide(k8spod.From(p), capture.Config{ExcludeNamespaces: []string{"kube-system"}})
		if d.Captured() != want[p.Name] {
			t.Errorf("%s: meshed=%v (%s), want %v", p.Name, d.Captured(), d.Reason, want[p.Name])
		}
		// The product image runs only the validation init container; the app and
		// the istio-proxy stand-in run the demo tool's own image.
		for _, c := range p.Spec.InitContainers {
			if c.Image != product {
				t.Errorf("%s/%s: image %s, want %s", p.Name, c.Name, c.Image, product)
			}
		}
		if p.Name != ServerPod {
			for _, c := range p.Spec.Containers {
				if c.Image != proxysim {
					t.Errorf("%s/%s: image %s, want %s", p.Name, c.Name, c.Image, proxysim)
				}
			}
		}
		for _, c := range append(append([]corev1.Container{}, p.Spec.InitContainers...), p.Spec.Containers...) {
			if sc := c.SecurityContext; sc != nil && sc.Capabilities != nil && len(sc.Capabilities.Add) > 0 {
				t.Errorf("%s/%s adds capabilities %v", p.Name, c.Name, sc.Capabilities.Add)
			}
			if p.Name != ServerPod && (c.SecurityContext == nil || c.SecurityContext.RunAsUser == nil || *c.SecurityContext.RunAsUser == 0) {
				t.Errorf("%s/%s does not run as a non-root UID", p.Name, c.Name)
			}
		}
		if p.Name == MeshedPod {
			s, err := capture.Spec(k8spod.From(p))
			if err != nil {
				t.Fatal(err)
			}
			if len(s.ProxyUIDs) != 1 || s.ProxyUIDs[0] != ProxyUID {
				t.Errorf("proxy UIDs %v, want [%d]", s.ProxyUIDs, ProxyUID)
			}
		}
	}
}

func TestParseRecords(t *testing.T) {
	logs := strings.Join([]string{
		`{"time":"2026-01-01T00:00:00Z","level":"INFO","msg":"listening"}`,
		`{"event":"ready","listeners":["outbound 0.0.0.0:15001"],"uid":1337,"gid":1337,"time":"2026-01-01T00:00:00Z"}`,
		`not json at all`,
		`{"event":"conn","listener":"outbound","proto":"tcp","peer":"10.213.0.7:40000","local":"127.0.0.1:15001","orig_dst":"10.213.0.5:8080","uid":1337,"gid":1337,"time":"2026-01-01T00:00:00Z"}`,
		`{"event":"conn","broken"`,
		``,
	}, "\n")
	recs := parseRecords(logs)
	if len(recs) != 2 || recs[0].Event != proxysim.EventReady || recs[1].Event != proxysim.EventConn {
		t.Fatalf("records %+v", recs)
	}
	if recs[1].OrigDst != netip.MustParseAddrPort("10.213.0.5:8080") || recs[1].Peer != netip.MustParseAddrPort("10.213.0.7:40000") {
		t.Errorf("record %+v", recs[1])
	}
}

func TestSeenSource(t *testing.T) {
	for _, tc := range []struct {
		to, reply, want string
	}{
		{ServerPod, "server 10.213.0.7:41234\nhello from meshed\n", "10.213.0.7:41234"},
		{ServerPod, "server\n", ""},
		{ServerPod, "", ""},
		{PlainPod, `{"event":"conn","listener":"inbound","peer":"127.0.0.6:39999","local":"10.213.0.8:9080","uid":1000,"gid":1000,"time":"2026-01-01T00:00:00Z"}` + "\n", "127.0.0.6:39999"},
		{MeshedPod, "garbage", ""},
	} {
		got := seenSource(tc.to, tc.reply)
		if (tc.want == "" && got.IsValid()) || (tc.want != "" && got.String() != tc.want) {
			t.Errorf("seenSource(%s, %q) = %v, want %q", tc.to, tc.reply, got, tc.want)
		}
	}
}

func TestPrintGolden(t *testing.T) {
	tr := true
	rep := &Report{
		Image: &image.Result{Ref: "meshcni.local/meshcni:dev", ArchiveSize: 34_100_000, IndexDigest: "sha256:0123"},
		Steps: []Step{{"image built", 12 * time.Second}, {"agent ready", 1500 * time.Millisecond}},
		Pods: []PodRow{
			{Pod: "meshcni-demo/meshed", IP: "10.213.0.9", Meshed: true, Reason: "istio-proxy sidecar container injected by Istio", Rules: "nftables (in-sync)", Validation: "passed (exit 0)", ProxyConns: 3},
			{Pod: "meshcni-demo/plain", IP: "10.213.0.8", Reason: "no istio-proxy container", Rules: "none (not-meshed)", Validation: "-", ProxyConns: -1},
		},
		Connections: []ConnRow{
			{From: "meshed/app (uid 1000)", To: "server 10.213.0.7:8080", Captured: "outbound :15001", OrigDst: "10.213.0.7:8080", SeenSource: "10.213.0.9", OK: true, want: "captured on outbound"},
			{From: "meshed/istio-proxy (uid 1337)", To: "server 10.213.0.7:8080", Captured: "no", OrigDst: "-", SeenSource: "10.213.0.9", OK: false, want: "not captured"},
		},
		Inspect: &InspectReport{Pod: "meshcni-demo/meshed", Meshed: &tr, Netns: "/run/x/cni-1", Status: "in-sync",
			Live: map[string]string{"nftables": "table inet meshcni {\n  chain output {\n  }\n}\n", "iptables-nft": " \n"}, Command: "meshcnictl inspect meshcni-demo/meshed"},
		Failures: []string{"meshed/istio-proxy (uid 1337) → server 10.213.0.7:8080: the proxy captured it"},
	}
	var buf bytes.Buffer
	Print(&buf, rep)
	golden.Open(t, "testdata").Check(t, "report.golden", buf.Bytes())
}

// TestDemo is `make demo` end to end on the real test bed: image built and imported,
// chart installed with Helm, agent DaemonSet ready and plugin installed by it, demo
// pods, traffic, inspect — twice, the second run on top of the first's install (a
// rebuilt image rolls the agent) — then uninstall (the agent must take the plugin
// out of the node). Under CI=true it must run.
func TestDemo(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "go")
	testutil.RequireBinary(t, "ctr")
	root, err := testbed.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	tb := testbed.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	// Twice, as a user runs `make demo` again on the running install: first keeping
	// everything (make demo), then on top of it and uninstalling at the end.
	for _, keep := range []bool{true, false} {
		var out bytes.Buffer
		began := time.Now()
		rep, err := Run(ctx, tb, Options{RepoRoot: root, Out: &out, Keep: keep})
		t.Logf("demo (keep %v) output:\n%s", keep, out.String())
		if err != nil {
			if keep {
				_ = Down(context.Background(), tb, root, "", 0)
			}
			t.Fatal(err)
		}
		t.Logf("demo (keep %v) took %s", keep, time.Since(began).Round(time.Millisecond))
		if len(rep.Connections) != len(probes()) {
			t.Errorf("%d connections in the report, want %d", len(rep.Connections), len(probes()))
		}
		captured := 0
		for _, c := range rep.Connections {
			if !c.OK {
				t.Errorf("connection not as expected: %+v", c)
			}
			if c.Captured != "no" {
				captured++
			}
		}
		if captured != 3 {
			t.Errorf("%d connections captured, want 3", captured)
		}
		if rep.Inspect == nil || rep.Inspect.Status != "in-sync" || len(rep.Inspect.Backends()) != 1 {
			t.Errorf("inspect of the meshed pod: %+v", rep.Inspect)
		}
		for _, want := range []string{"REDIRECTED", "outbound :15001", "inbound :15006", "127.0.0.6", "OK: "} {
			if !strings.Contains(out.String(), want) {
				t.Errorf("output lacks %q", want)
			}
		}
		bin, entry, err := pluginState("")
		if keep && (err != nil || !bin || !entry) {
			t.Errorf("kept install: plugin binary %v, entry %v, err %v", bin, entry, err)
		}
	}
	// Uninstalled: the agent removed the plugin from the node.
	bin, entry, err := pluginState("")
	if err != nil || bin || entry {
		t.Errorf("after the demo: plugin binary %v, entry %v, err %v", bin, entry, err)
	}
}

// TestMultiArchImageImports: an archive with a two-architecture index (this
// machine's meshcnictl, and a stand-in file for the other architecture) is accepted by
// the test bed's containerd (`ctr images import`), which picks this machine's manifest
// for a pod that runs `meshcnictl --help` from it.
func TestMultiArchImageImports(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "go")
	testutil.RequireBinary(t, "ctr")
	root, err := testbed.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	tb := testbed.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	host := image.HostArch()
	other := image.Arch{GOARCH: "arm64"}
	if host.GOARCH == "arm64" {
		other = image.Arch{GOARCH: "amd64"}
	}
	dir := t.TempDir()
	if err := image.GoBuild(ctx, root, host, "multiarch-test", filepath.Join(dir, "host"), []string{"meshcnictl"}); err != nil {
		t.Fatal(err)
	}
	fake := filepath.Join(dir, "other-meshcnictl")
	if err := os.WriteFile(fake, []byte("not for this machine\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	const tag = "multiarch-test"
	ref, err := image.Ref(image.DefaultHub, tag)
	if err != nil {
		t.Fatal(err)
	}
	archive := filepath.Join(dir, "multi.tar")
	res, err := image.Assemble(ctx, image.AssembleOptions{
		Ref: ref, Tag: tag, Version: tag, Revision: "test",
		Arches: []image.Arch{other, host},
		Binaries: map[image.Arch]map[string]string{
			host:  {"meshcnictl": filepath.Join(dir, "host", "meshcnictl")},
			other: {"meshcnictl": fake},
		},
		Out: archive,
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := testbed.ImportImage(ctx, archive); err != nil {
		t.Fatal(err)
	}
	out, err := exec.CommandContext(ctx, "ctr", "--address", testbed.ContainerdSocket(), "-n", "k8s.io", "images", "ls", "name=="+ref).CombinedOutput()
	if err != nil {
		t.Fatalf("ctr images ls: %v: %s", err, out)
	}
	for _, want := range []string{ref, res.IndexDigest, "linux/" + host.String(), "linux/" + other.String()} {
		if !strings.Contains(string(out), want) {
			t.Errorf("ctr images ls lacks %q:\n%s", want, out)
		}
	}

	ns := "meshcni-demo-image"
	if err := tb.CreateNamespace(ctx, ns); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = tb.Client.CoreV1().Namespaces().Delete(context.Background(), ns, metav1.DeleteOptions{})
	})
	uid := int64(65534)
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "meshcnictl-help", Namespace: ns},
		Spec: corev1.PodSpec{
			RestartPolicy: corev1.RestartPolicyNever,
			Containers: []corev1.Container{{
				Name: "ctl", Image: ref, ImagePullPolicy: corev1.PullNever,
				Command:         []string{image.PathInImage("meshcnictl"), "--help"},
				SecurityContext: &corev1.SecurityContext{RunAsUser: &uid, RunAsGroup: &uid},
			}},
		},
	}
	if _, err := tb.CreatePod(ctx, pod); err != nil {
		t.Fatal(err)
	}
	var phase corev1.PodPhase
	for phase != corev1.PodSucceeded {
		p, err := tb.Client.CoreV1().Pods(ns).Get(ctx, pod.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		phase = p.Status.Phase
		if phase == corev1.PodFailed {
			t.Fatalf("pod failed: %+v", p.Status.ContainerStatuses)
		}
		select {
		case <-ctx.Done():
			t.Fatalf("pod not Succeeded: phase %s, %+v", phase, p.Status.ContainerStatuses)
		case <-time.After(100 * time.Millisecond):
		}
	}
	logs, err := tb.PodLogs(ctx, ns, pod.Name, "ctl")
	if err != nil || !strings.Contains(logs, "meshcnictl") || !strings.Contains(logs, "inspect") {
		t.Errorf("meshcnictl --help in the pod: %v\n%s", err, logs)
	}
}

// TestJudge: each way a connection can differ from what the demo shows is reported.
func TestJudge(t *testing.T) {
	ips := map[string]netip.Addr{
		MeshedPod: netip.MustParseAddr("10.213.0.4"),
		PlainPod:  netip.MustParseAddr("10.213.0.2"),
		ServerPod: netip.MustParseAddr("10.213.0.3"),
	}
	ps := probes()
	appToServer, proxyToServer, plainToMeshed := ps[0], ps[2], ps[3]
	if appToServer.want != proxysim.ListenerOutbound || proxyToServer.want != "" || plainToMeshed.want != proxysim.ListenerInbound {
		t.Fatalf("probes() changed order: %+v", ps)
	}
	server := netip.MustParseAddrPort("10.213.0.3:8080")
	meshedApp := netip.MustParseAddrPort("10.213.0.4:9080")
	local := netip.MustParseAddrPort("10.213.0.4:40000")
	plainLocal := netip.MustParseAddrPort("10.213.0.2:41000")
	conn := func(listener string, port uint16, peer, orig netip.AddrPort) proxysim.Record {
		return proxysim.Record{Event: proxysim.EventConn, Listener: listener, Peer: peer,
			Local: netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), port), OrigDst: orig}
	}
	echo := func(from string) string { return "server " + from + ":5555\nhello\n" }
	appReply := func(peer string) string {
		return `{"event":"conn","listener":"inbound","peer":"` + peer + `:6000","local":"10.213.0.4:9080","uid":1000,"gid":1000,"time":"2026-01-01T00:00:00Z"}` + "\n"
	}
	ok := func(local netip.AddrPort, reply string) proxysim.ProbeResult {
		return proxysim.ProbeResult{Connected: true, Local: local, Reply: reply}
	}
	for _, tc := range []struct {
		name    string
		s       sent
		records []proxysim.Record
		want    string // substring of the problems; "" = OK
		capt    string
	}{
		{"outbound captured", sent{p: appToServer, dst: server, res: ok(local, echo("10.213.0.4"))},
			[]proxysim.Record{conn("outbound", 15001, local, server)}, "", "outbound :15001"},
		{"outbound not captured", sent{p: appToServer, dst: server, res: ok(local, echo("10.213.0.4"))},
			nil, "the proxy did not see it", "no"},
		{"outbound on the wrong listener", sent{p: appToServer, dst: server, res: ok(local, echo("10.213.0.4"))},
			[]proxysim.Record{conn("inbound", 15006, local, server)}, "captured by the inbound listener", "inbound :15006"},
		{"wrong original destination", sent{p: appToServer, dst: server, res: ok(local, echo("10.213.0.4"))},
			[]proxysim.Record{conn("outbound", 15001, local, netip.MustParseAddrPort("10.213.0.9:8080"))}, "original destination 10.213.0.9:8080", "outbound :15001"},
		{"forward failed", sent{p: appToServer, dst: server, res: ok(local, echo("10.213.0.4"))},
			[]proxysim.Record{func() proxysim.Record {
				r := conn("outbound", 15001, local, server)
				r.ForwardErr = "refused"
				return r
			}()}, "forward failed: refused", "outbound :15001"},
		{"another connection's record does not count", sent{p: appToServer, dst: server, res: ok(local, echo("10.213.0.4"))},
			[]proxysim.Record{conn("outbound", 15001, netip.MustParseAddrPort("10.213.0.4:40001"), server)}, "the proxy did not see it", "no"},
		{"proxy's own traffic captured", sent{p: proxyToServer, dst: server, res: ok(local, echo("10.213.0.4"))},
			[]proxysim.Record{conn("outbound", 15001, local, server)}, "must not be redirected", "outbound :15001"},
		{"proxy's own traffic not captured", sent{p: proxyToServer, dst: server, res: ok(local, echo("10.213.0.4"))},
			nil, "", "no"},
		{"inbound captured, app sees 127.0.0.6", sent{p: plainToMeshed, dst: meshedApp, res: ok(plainLocal, appReply("127.0.0.6"))},
			[]proxysim.Record{conn("inbound", 15006, plainLocal, meshedApp)}, "", "inbound :15006"},
		{"inbound: app sees the client directly", sent{p: plainToMeshed, dst: meshedApp, res: ok(plainLocal, appReply("10.213.0.2"))},
			[]proxysim.Record{conn("inbound", 15006, plainLocal, meshedApp)}, "saw the connection from 10.213.0.2, want 127.0.0.6", "inbound :15006"},
		{"not connected", sent{p: proxyToServer, dst: server, res: proxysim.ProbeResult{Error: "refused"}},
			nil, "not connected: refused", "no"},
		{"no answer", sent{p: proxyToServer, dst: server, res: ok(local, "")},
			nil, "no answer from server", "no"},
		{"exec failed", sent{p: proxyToServer, dst: server, err: errors.New("exec: boom")},
			nil, "exec: boom", "no"},
	} {
		row, problems := judge(tc.s, tc.records, ips)
		got := strings.Join(problems, "; ")
		if (tc.want == "") != row.OK || (tc.want == "" && got != "") || !strings.Contains(got, tc.want) {
			t.Errorf("%s: OK=%v problems %q, want %q", tc.name, row.OK, got, tc.want)
		}
		if row.Captured != tc.capt {
			t.Errorf("%s: captured %q, want %q", tc.name, row.Captured, tc.capt)
		}
	}
}
