package plugin

import (
	"encoding/json"
	"errors"
	"net/netip"
	"strings"
	"testing"

	"github.com/containernetworking/cni/pkg/types"
	corev1 "k8s.io/api/core/v1"

	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/capture"
)

// Under Multus meshcni runs as an additional network from its own list (the
// agent's standalone list): its ADD gets no prevResult. It then takes the pod's
// addresses from the pod's netns and prints an empty result, as istio-cni does.

// fakeAddrs replaces the netns read: it records the netns asked for.
type fakeAddrs struct {
	addrs []netip.Addr
	err   error
	asked []string
}

func (f *fakeAddrs) read(netns string) ([]netip.Addr, error) {
	f.asked = append(f.asked, netns)
	return f.addrs, f.err
}

func addrs(s ...string) []netip.Addr {
	var out []netip.Addr
	for _, a := range s {
		out = append(out, netip.MustParseAddr(a))
	}
	return out
}

func dualStack(p *corev1.Pod) *corev1.Pod {
	p.Spec.Containers[1].Env = []corev1.EnvVar{{Name: capture.EnvDualStack, Value: "true"}}
	return p
}

func TestAddWithoutPrevResult(t *testing.T) {
	for _, tt := range []struct {
		name       string
		pod        *corev1.Pod
		addrs      []netip.Addr
		ipv4, ipv6 bool // the families the applied spec captures
	}{
		{"ipv4 pod", meshed("app", "web", nil), addrs("10.0.0.5"), true, false},
		{"dual-stack pod, single-stack proxy", meshed("app", "web", nil), addrs("10.0.0.5", "fd00::5"), true, false},
		{"dual-stack pod and proxy", dualStack(meshed("app", "web", nil)), addrs("10.0.0.5", "fd00::5"), true, true},
		{"ipv6-only pod", meshed("app", "web", nil), addrs("fd00::5"), false, true},
	} {
		for _, ver := range []string{"0.3.1", "0.4.0", "1.0.0", "1.1.0"} {
			t.Run(tt.name+"/"+ver, func(t *testing.T) {
				h := newHarness(t)
				h.api.AddPod(tt.pod)
				fa := &fakeAddrs{addrs: tt.addrs}
				h.p.PodAddrs = fa.read
				if err := h.p.Add(cmdArgs("app", "web", "uid-web", conf(t, ver, h.runDir, "", nil))); err != nil {
					t.Fatal(err)
				}
				if len(fa.asked) != 1 || fa.asked[0] != "/var/run/netns/none" {
					t.Fatalf("netns addresses read for %v, want once for the pod's netns", fa.asked)
				}
				if len(h.eng.applied) != 1 {
					t.Fatalf("applied %d times", len(h.eng.applied))
				}
				if s := h.eng.applied[0]; s.EnableIPv4 != tt.ipv4 || s.IPv6Captured() != tt.ipv6 {
					t.Fatalf("spec captures ipv4 %v ipv6 %v, want %v %v", s.EnableIPv4, s.IPv6Captured(), tt.ipv4, tt.ipv6)
				}
				assertEmptyResult(t, h.stdout.Bytes(), ver)
			})
		}
	}
}

// assertEmptyResult: stdout is a result of version ver with no interface and no IP.
func assertEmptyResult(t *testing.T, stdout []byte, ver string) {
	t.Helper()
	var out map[string]any
	if err := json.Unmarshal(stdout, &out); err != nil {
		t.Fatalf("stdout %q: %v", stdout, err)
	}
	if out["cniVersion"] != ver || out["ips"] != nil || out["interfaces"] != nil {
		t.Fatalf("result %s, want an empty result of version %s", stdout, ver)
	}
}

// TestAddWithoutPrevResultNotMeshed: a pod that is not meshed (or not a Kubernetes
// pod) gets the empty result without the netns being read.
func TestAddWithoutPrevResultNotMeshed(t *testing.T) {
	plain := meshed("app", "plain", nil)
	plain.Annotations = nil
	for _, args := range []struct{ ns, name string }{{"app", "plain"}, {"kube-system", "dns"}, {"", ""}} {
		h := newHarness(t)
		h.api.AddPod(plain)
		fa := &fakeAddrs{err: errors.New("must not be read")}
		h.p.PodAddrs = fa.read
		if err := h.p.Add(cmdArgs(args.ns, args.name, "", conf(t, "1.0.0", h.runDir, "", nil))); err != nil {
			t.Fatalf("%s/%s: %v", args.ns, args.name, err)
		}
		if len(fa.asked) != 0 || len(h.eng.applied) != 0 {
			t.Fatalf("%s/%s: netns read %v, applied %d", args.ns, args.name, fa.asked, len(h.eng.applied))
		}
		assertEmptyResult(t, h.stdout.Bytes(), "1.0.0")
	}
}

// TestAddWithoutPrevResultFailsClosed: a netns that cannot be read fails the ADD
// with no rule applied and nothing printed (a netns with no address:
// TestAddFailures).
func TestAddWithoutPrevResultFailsClosed(t *testing.T) {
	for _, tt := range []struct {
		name string
		fa   *fakeAddrs
		want []string
	}{
		{"netns unreadable", &fakeAddrs{err: errors.New("enter netns /var/run/netns/none: no such file or directory")},
			[]string{"no IP in a prevResult", "cannot read the addresses of pod app/web", "no such file or directory", "fails closed"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t)
			h.api.AddPod(meshed("app", "web", nil))
			h.p.PodAddrs = tt.fa.read
			e := cniErr(t, h.p.Add(cmdArgs("app", "web", "", conf(t, "1.0.0", h.runDir, "", nil))))
			if e.Code != types.ErrInternal {
				t.Errorf("code %d", e.Code)
			}
			for _, w := range tt.want {
				if !strings.Contains(e.Msg, w) {
					t.Errorf("message %q lacks %q", e.Msg, w)
				}
			}
			if len(h.eng.applied) != 0 || h.stdout.Len() != 0 {
				t.Fatalf("applied %d, stdout %q", len(h.eng.applied), h.stdout)
			}
		})
	}
}

// TestCheckWithoutPrevResult: CHECK of the standalone list compares the rules of the
// spec built from the netns's addresses.
func TestCheckWithoutPrevResult(t *testing.T) {
	h := newHarness(t)
	h.api.AddPod(meshed("app", "web", nil))
	fa := &fakeAddrs{addrs: addrs("10.0.0.5")}
	h.p.PodAddrs = fa.read
	c := conf(t, "1.0.0", h.runDir, "", nil)
	if err := h.p.Check(cmdArgs("app", "web", "", c)); err != nil {
		t.Fatal(err)
	}
	if len(fa.asked) != 1 {
		t.Fatalf("netns read %v", fa.asked)
	}
	h.eng.drift = backend.Drift{Missing: []string{"nat ISTIO_OUTPUT -j ISTIO_REDIRECT"}}
	if e := cniErr(t, h.p.Check(cmdArgs("app", "web", "", c))); !strings.Contains(e.Msg, "drifted") {
		t.Fatalf("%+v", e)
	}
}

// TestPrevResultWithoutIPs: a prevResult with no IP (the empty result of ADD, which
// libcni and Multus pass back at CHECK) makes the plugin read the netns too; one
// with IPs is used as it is, and the netns is not read.
func TestPrevResultWithoutIPs(t *testing.T) {
	for _, tt := range []struct {
		name       string
		prev       string
		readNetns  bool
		ipv4, ipv6 bool
	}{
		{"empty result", `{"cniVersion":"1.0.0"}`, true, false, true},
		{"prevResult with IPs", prevResult100, false, true, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t)
			h.api.AddPod(meshed("app", "web", nil))
			fa := &fakeAddrs{addrs: addrs("fd00::5")} // IPv6 only: Istio captures IPv6, not IPv4
			h.p.PodAddrs = fa.read
			if err := h.p.Add(cmdArgs("app", "web", "", conf(t, "1.0.0", h.runDir, tt.prev, nil))); err != nil {
				t.Fatal(err)
			}
			if got := len(fa.asked) == 1; got != tt.readNetns {
				t.Fatalf("netns read %v, want read: %v", fa.asked, tt.readNetns)
			}
			if s := h.eng.applied[0]; s.EnableIPv4 != tt.ipv4 || s.IPv6Captured() != tt.ipv6 {
				t.Fatalf("spec captures ipv4 %v ipv6 %v, want %v %v", s.EnableIPv4, s.IPv6Captured(), tt.ipv4, tt.ipv6)
			}
		})
	}
}
