package testbed

import (
	"context"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// nodeEchoPod is EchoPod scheduled onto node (by the kubernetes.io/hostname
// label), with the node's CNI configuration directory mounted at /host-cni.
func nodeEchoPod(name, node string) *corev1.Pod {
	p := EchoPod(name, 0)
	p.Spec.NodeSelector = map[string]string{"kubernetes.io/hostname": node}
	p.Spec.Volumes = append(p.Spec.Volumes, corev1.Volume{Name: "cni", VolumeSource: corev1.VolumeSource{
		HostPath: &corev1.HostPathVolumeSource{Path: CNIConfDir}}})
	c := &p.Spec.Containers[0]
	c.VolumeMounts = append(c.VolumeMounts, corev1.VolumeMount{Name: "cni", MountPath: "/host-cni", ReadOnly: true})
	return p
}

// TestThreeNodes is the proof that the test bed runs several real nodes: three
// nodes go Ready; a pod scheduled on each sees its own node's CNI directory
// through a hostPath volume (each node has its own mount namespace) and gets an
// IP of its node's range; every pod reaches every other across nodes by pod IP
// with real TCP, and the server sees the client's pod IP (no NAT); a pod on an
// extra node reaches the API server at NodeIP:6443; a node is removed (drained,
// Node deleted, its veth, cgroups, namespaces and directory gone) and another
// joins the running cluster and runs a pod, then dies (Kill) without disturbing
// the others and is removed; Stop leaves nothing behind.
func TestThreeNodes(t *testing.T) {
	requireOwnTestbed(t)
	tb := start(t, Options{Nodes: 3})
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()

	nodes := tb.Nodes()
	if len(nodes) != 3 {
		t.Fatalf("Nodes() = %d nodes, want 3", len(nodes))
	}
	for _, n := range nodes[1:] {
		t.Logf("node %s (%s, pods %s) Ready %s after its containerd started", n.Name, n.IP, n.PodCIDR, n.StartupTime.Round(time.Millisecond))
	}
	list, err := tb.Client.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil || len(list.Items) != 3 {
		t.Fatalf("API lists %v nodes (%v), want 3", len(list.Items), err)
	}

	pods := map[string]*corev1.Pod{}
	for i, n := range nodes {
		name := "echo-" + strconv.Itoa(i+1)
		if _, err := tb.CreatePod(ctx, nodeEchoPod(name, n.Name)); err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tb.DeletePod(context.Background(), "default", name) }()
	}
	for i, n := range nodes {
		name := "echo-" + strconv.Itoa(i+1)
		p, err := tb.WaitPodReady(ctx, "default", name)
		if err != nil {
			t.Fatal(err)
		}
		if p.Spec.NodeName != n.Name || !mustCIDR(n.PodCIDR).Contains(net.ParseIP(p.Status.PodIP)) {
			t.Fatalf("pod %s on %s with IP %s, want node %s and an IP in %s", name, p.Spec.NodeName, p.Status.PodIP, n.Name, n.PodCIDR)
		}
		// The hostPath volume shows this node's CNI configuration: its own range.
		out, _, err := tb.Exec(ctx, "default", name, "echo", "/echo", "cat", "/host-cni/"+DefaultConflistName)
		if err != nil || !strings.Contains(out, `"subnet": "`+n.PodCIDR+`"`) {
			t.Fatalf("pod %s on %s sees conflist %q (%v), want its node's range %s", name, n.Name, out, err, n.PodCIDR)
		}
		pods[n.Name] = p
	}

	// Every pod to every other pod, across nodes, from inside the client pod's netns.
	for ci, cn := range nodes {
		for _, sn := range nodes {
			if sn == cn {
				continue
			}
			client, server := pods[cn.Name], pods[sn.Name]
			var line string
			err := tb.InPodNetns(ctx, "default", "echo-"+strconv.Itoa(ci+1), func() error {
				var err error
				line, err = echoRoundTrip(net.JoinHostPort(server.Status.PodIP, strconv.Itoa(EchoPort)))
				return err
			})
			if err != nil {
				t.Fatalf("pod on %s to pod on %s (%s): %v", cn.Name, sn.Name, server.Status.PodIP, err)
			}
			f := strings.Fields(line)
			if len(f) != 2 || !strings.HasPrefix(f[1], client.Status.PodIP+":") {
				t.Fatalf("pod on %s to pod on %s: server saw %q, want the client's pod IP %s (no NAT)", cn.Name, sn.Name, line, client.Status.PodIP)
			}
		}
	}
	t.Log("pod to pod by pod IP across all node pairs, no NAT")

	// The API server from a pod on an extra node.
	err = tb.InPodNetns(ctx, "default", "echo-3", func() error {
		c, err := net.DialTimeout("tcp", net.JoinHostPort(ClusterAPIServerHost, strconv.Itoa(APIServerPort)), 3*time.Second)
		if err == nil {
			c.Close()
		}
		return err
	})
	if err != nil {
		t.Fatalf("API server from a pod on %s: %v", nodes[2].Name, err)
	}

	// Remove node 3: drained, gone from the API, no trace on the host.
	gone := nodes[2]
	if err := gone.Remove(ctx); err != nil {
		t.Fatalf("remove %s: %v", gone.Name, err)
	}
	if _, err := tb.Client.CoreV1().Nodes().Get(ctx, gone.Name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("node %s still in the API (%v)", gone.Name, err)
	}
	if _, err := tb.Client.CoreV1().Pods("default").Get(ctx, "echo-3", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("pod echo-3 of the removed node still exists (%v)", err)
	}
	if left := nodeTraces(gone); len(left) > 0 {
		t.Fatalf("removed node %s left: %v", gone.Name, left)
	}
	daemons := map[string]int{}
	for _, p := range ourProcesses() {
		daemons[p.comm]++
	}
	if daemons["kubelet"] != 2 || daemons["containerd"] != 2 {
		t.Errorf("after removing a node %d kubelets and %d containerds run, want 2 of each", daemons["kubelet"], daemons["containerd"])
	}
	if len(tb.Nodes()) != 2 {
		t.Fatalf("Nodes() after remove = %d, want 2", len(tb.Nodes()))
	}

	// A node joins the running cluster and runs a pod reachable from node 1's pod.
	joined, err := tb.AddNode(ctx, "joiner")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("node %s joined, Ready %s after its containerd started", joined.Name, joined.StartupTime.Round(time.Millisecond))
	if _, err := tb.CreatePod(ctx, nodeEchoPod("echo-j", joined.Name)); err != nil {
		t.Fatal(err)
	}
	pj, err := tb.WaitPodReady(ctx, "default", "echo-j")
	if err != nil {
		t.Fatal(err)
	}
	err = tb.InPodNetns(ctx, "default", "echo-1", func() error {
		_, err := echoRoundTrip(net.JoinHostPort(pj.Status.PodIP, strconv.Itoa(EchoPort)))
		return err
	})
	if err != nil {
		t.Fatalf("node 1's pod to the joined node's pod: %v", err)
	}

	// The joined node dies (Kill); the others keep working; Remove then cleans
	// up its Node, its pod and its traces.
	if err := joined.Kill(); err != nil {
		t.Fatal(err)
	}
	err = tb.InPodNetns(ctx, "default", "echo-1", func() error {
		_, err := echoRoundTrip(net.JoinHostPort(pods[nodes[1].Name].Status.PodIP, strconv.Itoa(EchoPort)))
		return err
	})
	if err != nil {
		t.Fatalf("node 1's pod to node 2's pod after a node died: %v", err)
	}
	if err := joined.Remove(ctx); err != nil {
		t.Fatalf("remove the dead node: %v", err)
	}
	if _, err := tb.Client.CoreV1().Pods("default").Get(ctx, "echo-j", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("pod echo-j of the dead node still exists (%v)", err)
	}
	if left := nodeTraces(joined); len(left) > 0 {
		t.Fatalf("dead node %s left after Remove: %v", joined.Name, left)
	}

	stopClean(t, tb)
	for _, n := range []*Node{nodes[1], joined} {
		if left := nodeTraces(n); len(left) > 0 {
			t.Errorf("node %s left after Stop: %v", n.Name, left)
		}
	}
}

// nodeTraces lists what an extra node left on the host.
func nodeTraces(n *Node) []string {
	var out []string
	if _, err := net.InterfaceByName(n.plan.HostVeth()); err == nil {
		out = append(out, "link "+n.plan.HostVeth())
	}
	if cg := nodeCgroupDirs(n.Name); len(cg) > 0 {
		out = append(out, fmt.Sprintf("cgroups %v", cg))
	}
	for _, f := range []string{n.plan.Dir(), n.plan.NetnsFile(), n.plan.MntnsFile()} {
		if _, err := os.Stat(f); err == nil {
			out = append(out, f)
		}
	}
	for _, p := range ourProcesses() {
		if strings.Contains(cmdline(p.pid), n.plan.Dir()) {
			out = append(out, fmt.Sprintf("process %d(%s)", p.pid, p.comm))
		}
	}
	routes, _ := netlink.RouteList(nil, netlink.FAMILY_V4)
	for _, r := range routes {
		if r.Dst != nil && r.Dst.String() == n.PodCIDR {
			out = append(out, "route "+r.String())
		}
	}
	return out
}

// BenchmarkAddNode measures joining an extra node to a running one-node test bed
// and removing it again, once per iteration. Reported: ready-ms (the node's first
// process start to Ready, median), add-ms (AddNode as a whole: certificates,
// namespaces, cgroups, daemons, images), remove-ms (Remove: drain, stop, traces).
func BenchmarkAddNode(b *testing.B) {
	requireOwnTestbed(b)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	tb, err := Start(ctx, Options{})
	if err != nil {
		b.Fatalf("start: %v", err)
	}
	defer func() { _ = tb.Stop(context.Background()) }()
	var ready, adds, removes []time.Duration
	for b.Loop() {
		began := time.Now()
		n, err := tb.AddNode(ctx, "bench")
		if err != nil {
			b.Fatal(err)
		}
		adds, ready = append(adds, time.Since(began)), append(ready, n.StartupTime)
		began = time.Now()
		if err := n.Remove(ctx); err != nil {
			b.Fatal(err)
		}
		removes = append(removes, time.Since(began))
	}
	if err := tb.Stop(context.Background()); err != nil {
		b.Fatal(err)
	}
	if left := Leftovers(); len(left) > 0 {
		b.Fatalf("stop left behind: %v", left)
	}
	b.ReportMetric(medianMs(ready), "ready-ms")
	b.ReportMetric(medianMs(adds), "add-ms")
	b.ReportMetric(medianMs(removes), "remove-ms")
}
