package capture

import (
	"errors"
	"net/netip"
	"reflect"
	"strings"
	"testing"

	"github.com/meshcni/meshcni/pkg/spec"
)

// PodOption mutates a test pod.
type podOpt func(*Pod)

func ann(k, v string) podOpt {
	return func(p *Pod) {
		if p.Annotations == nil {
			p.Annotations = map[string]string{}
		}
		p.Annotations[k] = v
	}
}

func label(k, v string) podOpt {
	return func(p *Pod) {
		if p.Labels == nil {
			p.Labels = map[string]string{}
		}
		p.Labels[k] = v
	}
}

func env(k, v string) podOpt {
	return func(p *Pod) {
		c, _ := FindProxy(p)
		c.Env = append(c.Env, EnvVar{Name: k, Value: v})
	}
}

func runAs(uid, gid *int64) podOpt {
	return func(p *Pod) {
		c, _ := FindProxy(p)
		c.SecurityContext = &SecurityContext{RunAsUser: uid, RunAsGroup: gid}
	}
}

func args(a ...string) podOpt {
	return func(p *Pod) {
		c, _ := FindProxy(p)
		c.Args = a
	}
}

var noProxy podOpt = func(p *Pod) { p.Spec.Containers = p.Spec.Containers[:1] }

var nativeSidecar podOpt = func(p *Pod) {
	always := ContainerRestartPolicyAlways
	proxy := p.Spec.Containers[1]
	proxy.RestartPolicy = &always
	p.Spec.Containers = p.Spec.Containers[:1]
	p.Spec.InitContainers = append(p.Spec.InitContainers, proxy)
}

var proxyAsPlainInit podOpt = func(p *Pod) {
	proxy := p.Spec.Containers[1]
	p.Spec.Containers = p.Spec.Containers[:1]
	p.Spec.InitContainers = append(p.Spec.InitContainers, proxy)
}

var withIstioInit podOpt = func(p *Pod) {
	p.Spec.InitContainers = append(p.Spec.InitContainers, Container{Name: InitContainer, Image: "istio/proxyv2"})
}

// meshedPod is what Istio's injector produces (without istio-init, as with istio-cni).
func meshedPod(opts ...podOpt) *Pod {
	p := &Pod{
		ObjectMeta: ObjectMeta{
			Name: "web", Namespace: "app", UID: "uid-1",
			Annotations: map[string]string{AnnotationStatus: `{"containers":["istio-proxy"]}`},
		},
		Spec: PodSpec{Containers: []Container{
			{Name: "app", Image: "app"},
			{Name: ProxyContainer, Image: "istio/proxyv2", Args: []string{"proxy", "sidecar", "--domain", "app.svc.cluster.local"}},
		}},
	}
	for _, o := range opts {
		o(p)
	}
	return p
}

func i64(v int64) *int64 { return &v }

func inNS(ns string) podOpt { return func(p *Pod) { p.Namespace = ns } }

func TestDecide(t *testing.T) {
	cfg := Config{ExcludeNamespaces: []string{"kube-system", "istio-system"}}
	agentCfg := Config{ExcludeNamespaces: cfg.ExcludeNamespaces, AgentNamespace: "meshcni-system"}
	tests := []struct {
		name   string
		pod    *Pod
		cfg    Config
		meshed bool
		reason string
	}{
		{"regular sidecar", meshedPod(), cfg, true, "sidecar container"},
		{"native sidecar", meshedPod(nativeSidecar), cfg, true, "native sidecar"},
		{"istio-proxy init container without restartPolicy Always", meshedPod(proxyAsPlainInit), cfg, false, "no istio-proxy container"},
		{"no proxy", meshedPod(noProxy), cfg, false, "no istio-proxy container"},
		{"no status annotation", meshedPod(func(p *Pod) { p.Annotations = nil }), cfg, false, "sidecar.istio.io/status"},
		{"excluded namespace", meshedPod(func(p *Pod) { p.Namespace = "kube-system" }), cfg, false, "namespace kube-system is excluded"},
		{"agent pod (default label, agent namespace)", meshedPod(inNS("meshcni-system"), label("app.kubernetes.io/name", "meshcni")), agentCfg, false, "meshcni's own"},
		{"agent pod (configured label)", meshedPod(inNS("meshcni-system"), label("k8s-app", "mesh-agent")), Config{AgentNamespace: "meshcni-system", AgentLabel: Label{"k8s-app", "mesh-agent"}}, false, "meshcni's own"},
		// The agent's label elsewhere is no opt-out: any workload could carry it.
		{"agent label in another namespace", meshedPod(label("app.kubernetes.io/name", "meshcni")), agentCfg, true, "sidecar container"},
		{"agent label, no agent namespace known", meshedPod(inNS("meshcni-system"), label("app.kubernetes.io/name", "meshcni")), cfg, true, "sidecar container"},
		{"other app label", meshedPod(label("app.kubernetes.io/name", "web")), cfg, true, ""},
		{"inject=false annotation", meshedPod(ann(AnnotationInject, "false")), cfg, false, "annotation sidecar.istio.io/inject=false"},
		{"inject=false label", meshedPod(label(AnnotationInject, "false")), cfg, false, "label sidecar.istio.io/inject=false"},
		{"label true wins over annotation false", meshedPod(label(AnnotationInject, "true"), ann(AnnotationInject, "false")), cfg, true, ""},
		{"label false wins over annotation true", meshedPod(label(AnnotationInject, "false"), ann(AnnotationInject, "true")), cfg, false, "label"},
		{"inject=true annotation", meshedPod(ann(AnnotationInject, "true")), cfg, true, ""},
		{"unparseable inject ignored", meshedPod(ann(AnnotationInject, "maybe")), cfg, true, ""},
		{"istio-init present", meshedPod(withIstioInit), cfg, false, "istio-init"},
		{"DISABLE_ENVOY=true", meshedPod(env(EnvDisableEnvoy, "true")), cfg, false, "DISABLE_ENVOY=true"},
		{"DISABLE_ENVOY=false", meshedPod(env(EnvDisableEnvoy, "false")), cfg, true, ""},
		{"router proxy", meshedPod(args("proxy", "router")), cfg, false, `"router" proxy`},
		{"no proxy args", meshedPod(args()), cfg, true, ""},
		{"interception NONE", meshedPod(ann(AnnotationInterceptionMode, "NONE")), cfg, false, "captures no traffic"},
		{"nil pod", nil, cfg, false, "no pod"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := Decide(tt.pod, tt.cfg)
			want := ModeNone
			if tt.meshed {
				want = ModeSidecar
			}
			if d.Mode != want || d.Captured() != tt.meshed {
				t.Fatalf("Mode = %q, Captured = %v (%s), want %q", d.Mode, d.Captured(), d.Reason, want)
			}
			if d.Reason == "" {
				t.Fatalf("empty reason")
			}
			if !strings.Contains(d.Reason, tt.reason) {
				t.Fatalf("reason %q does not mention %q", d.Reason, tt.reason)
			}
		})
	}
}

func ports(p ...uint16) []uint16 { return p }

func prefixes(s ...string) []netip.Prefix {
	var out []netip.Prefix
	for _, x := range s {
		out = append(out, netip.MustParsePrefix(x))
	}
	return out
}

func TestSpec(t *testing.T) {
	base := func(mut func(*spec.Spec)) *spec.Spec {
		s := spec.PodDefaults()
		s.OutboundPortsExclude = ports(15020)
		if mut != nil {
			mut(&s)
		}
		return &s
	}
	tests := []struct {
		name string
		pod  *Pod
		want *spec.Spec
		warn string
	}{
		{"defaults", meshedPod(), base(nil), ""},
		{"TPROXY", meshedPod(ann(AnnotationInterceptionMode, "TPROXY")), base(func(s *spec.Spec) { s.Mode = spec.ModeTProxy }), ""},
		{"REDIRECT explicit", meshedPod(ann(AnnotationInterceptionMode, "REDIRECT")), base(nil), ""},
		{"include inbound ports", meshedPod(ann(AnnotationIncludeInboundPorts, "8080, 9090")), base(func(s *spec.Spec) {
			s.InboundPorts = spec.PortSet{Ports: ports(8080, 9090)}
		}), ""},
		{"include inbound ports empty: no inbound capture", meshedPod(ann(AnnotationIncludeInboundPorts, "")), base(func(s *spec.Spec) {
			s.InboundPorts = spec.PortSet{}
		}), ""},
		{"exclude inbound ports: Istio's three are always added", meshedPod(ann(AnnotationExcludeInboundPorts, "7000,15021")), base(func(s *spec.Spec) {
			s.InboundPortsExclude = ports(7000, 15021, 15020, 15090)
		}), ""},
		{"include outbound ports", meshedPod(ann(AnnotationIncludeOutboundPorts, "3306")), base(func(s *spec.Spec) {
			s.OutboundPorts = ports(3306)
		}), ""},
		{"exclude outbound ports replace the 15020 default", meshedPod(ann(AnnotationExcludeOutboundPorts, "5432,6379")), base(func(s *spec.Spec) {
			s.OutboundPortsExclude = ports(5432, 6379)
		}), ""},
		{"exclude outbound ports empty", meshedPod(ann(AnnotationExcludeOutboundPorts, "")), base(func(s *spec.Spec) {
			s.OutboundPortsExclude = nil
		}), ""},
		{"include outbound ranges", meshedPod(ann(AnnotationIncludeOutboundIPRanges, "10.0.0.0/8,fd00::/8")), base(func(s *spec.Spec) {
			s.OutboundIPRanges = spec.PrefixSet{Prefixes: prefixes("10.0.0.0/8", "fd00::/8")}
		}), ""},
		{"exclude outbound ranges", meshedPod(ann(AnnotationExcludeOutboundIPRanges, "169.254.169.254/32, 10.96.0.1")), base(func(s *spec.Spec) {
			s.OutboundIPRangesExclude = prefixes("169.254.169.254/32", "10.96.0.1/32")
		}), ""},
		{"exclude interfaces", meshedPod(ann(AnnotationExcludeInterfaces, "eth1,net1")), base(func(s *spec.Spec) {
			s.ExcludeInterfaces = []string{"eth1", "net1"}
		}), ""},
		{"reroute virtual interfaces", meshedPod(ann(AnnotationRerouteVirtualInterfaces, "k6t-eth0, tap0")), base(func(s *spec.Spec) {
			s.RerouteInterfaces = []string{"k6t-eth0", "tap0"}
		}), ""},
		{"deprecated kubevirtInterfaces", meshedPod(ann(AnnotationKubevirtInterfaces, "tap1")), base(func(s *spec.Spec) {
			s.RerouteInterfaces = []string{"tap1"}
		}), ""},
		{"reroute wins over kubevirt", meshedPod(ann(AnnotationKubevirtInterfaces, "tap1"), ann(AnnotationRerouteVirtualInterfaces, "tap2")), base(func(s *spec.Spec) {
			s.RerouteInterfaces = []string{"tap2"}
		}), ""},
		{"runAsUser unset", meshedPod(runAs(nil, nil)), base(nil), ""},
		{"runAsUser 0 means 1337", meshedPod(runAs(i64(0), i64(0))), base(nil), ""},
		{"custom runAsUser/runAsGroup", meshedPod(runAs(i64(2000), i64(3000))), base(func(s *spec.Spec) {
			s.ProxyUIDs, s.ProxyGIDs = []uint32{2000}, []uint32{3000}
		}), ""},
		{"custom runAsUser only", meshedPod(runAs(i64(2000), nil)), base(func(s *spec.Spec) {
			s.ProxyUIDs = []uint32{2000}
		}), ""},
		{"native sidecar proxy settings are read", meshedPod(runAs(i64(4242), nil), nativeSidecar), base(func(s *spec.Spec) {
			s.ProxyUIDs = []uint32{4242}
		}), ""},
		{"DNS capture → capture all DNS", meshedPod(env(EnvDNSCapture, "true")), base(func(s *spec.Spec) {
			s.RedirectDNS, s.CaptureAllDNS = true, true
		}), ""},
		{"dual stack", meshedPod(env(EnvDualStack, "true")), base(func(s *spec.Spec) { s.EnableIPv6 = true }), ""},
		{"IPv6 mode capture", meshedPod(ann(AnnotationIPv6, "capture")), base(func(s *spec.Spec) { s.IPv6 = spec.IPv6Capture }), ""},
		{"IPv6 mode drop", meshedPod(ann(AnnotationIPv6, " DROP ")), base(func(s *spec.Spec) { s.IPv6 = spec.IPv6Drop }), ""},
		{"IPv6 mode istio", meshedPod(ann(AnnotationIPv6, "istio")), base(nil), ""},
		{"invalid drop", meshedPod(env(EnvInvalidDrop, "1")), base(func(s *spec.Spec) { s.DropInvalid = true }), ""},
		{"unparseable env ignored with a warning", meshedPod(env(EnvDNSCapture, "yes")), base(nil), "ISTIO_META_DNS_CAPTURE"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, err := Build(tt.pod)
			if err != nil {
				t.Fatalf("Build: %v", err)
			}
			if !reflect.DeepEqual(r.Spec, tt.want) {
				t.Fatalf("spec mismatch\n got  %+v\n want %+v", *r.Spec, *tt.want)
			}
			w := strings.Join(r.Warnings, "\n")
			if (tt.warn == "") != (w == "") || !strings.Contains(w, tt.warn) {
				t.Fatalf("warnings %q, want mention of %q", w, tt.warn)
			}
		})
	}
}

func TestSpecBadValues(t *testing.T) {
	tests := []struct {
		pod   *Pod
		field string
		value string
	}{
		{meshedPod(ann(AnnotationInterceptionMode, "MAGIC")), AnnotationInterceptionMode, "MAGIC"},
		{meshedPod(ann(AnnotationIncludeInboundPorts, "80,http")), AnnotationIncludeInboundPorts, "80,http"},
		{meshedPod(ann(AnnotationExcludeInboundPorts, "70000")), AnnotationExcludeInboundPorts, "70000"},
		{meshedPod(ann(AnnotationExcludeInboundPorts, "*")), AnnotationExcludeInboundPorts, "*"},
		{meshedPod(ann(AnnotationIncludeOutboundPorts, "0")), AnnotationIncludeOutboundPorts, "0"},
		{meshedPod(ann(AnnotationExcludeOutboundPorts, "-1")), AnnotationExcludeOutboundPorts, "-1"},
		{meshedPod(ann(AnnotationIncludeOutboundIPRanges, "10.0.0.0/33")), AnnotationIncludeOutboundIPRanges, "10.0.0.0/33"},
		{meshedPod(ann(AnnotationExcludeOutboundIPRanges, "not-a-cidr")), AnnotationExcludeOutboundIPRanges, "not-a-cidr"},
		{meshedPod(ann(AnnotationExcludeOutboundIPRanges, "*")), AnnotationExcludeOutboundIPRanges, "*"},
		{meshedPod(ann(AnnotationExcludeInterfaces, "eth0;rm")), AnnotationExcludeInterfaces, "eth0;rm"},
		{meshedPod(ann(AnnotationRerouteVirtualInterfaces, "averyveryverylongname")), AnnotationRerouteVirtualInterfaces, "averyveryverylongname"},
		{meshedPod(ann(AnnotationKubevirtInterfaces, "a b")), AnnotationKubevirtInterfaces, "a b"},
		{meshedPod(runAs(i64(-5), nil)), "istio-proxy.securityContext.runAsUser", "-5"},
		{meshedPod(ann(AnnotationIPv6, "pass")), AnnotationIPv6, "pass"},
		{meshedPod(ann(AnnotationIPv6, "")), AnnotationIPv6, ""},
		{meshedPod(ann(AnnotationIPv6, "true")), AnnotationIPv6, "true"},
		{meshedPod(ann(AnnotationEBPFAcceleration, "on")), AnnotationEBPFAcceleration, "on"},
		{meshedPod(ann(AnnotationEBPFAcceleration, "")), AnnotationEBPFAcceleration, ""},
		{meshedPod(ann(AnnotationEBPFAcceleration, "to_proxy")), AnnotationEBPFAcceleration, "to_proxy"},
	}
	for _, tt := range tests {
		t.Run(tt.field+"="+tt.value, func(t *testing.T) {
			s, err := Spec(tt.pod)
			if err == nil {
				t.Fatalf("no error, spec %+v", s)
			}
			var fe *spec.FieldError
			if !errors.As(err, &fe) {
				t.Fatalf("error %v is not a *spec.FieldError", err)
			}
			if fe.Field != tt.field || fe.Value != tt.value {
				t.Fatalf("error names %s=%q, want %s=%q", fe.Field, fe.Value, tt.field, tt.value)
			}
			if !strings.Contains(err.Error(), tt.field) || !strings.Contains(err.Error(), tt.value) {
				t.Fatalf("message %q does not name the annotation and value", err)
			}
		})
	}
}

// TestWithFamilies: the families Istio writes rules for (spec.IstioIPv6), from the
// pod's addresses and its proxy's ISTIO_DUAL_STACK (EnableIPv6 on entry).
func TestWithFamilies(t *testing.T) {
	for _, tt := range []struct {
		dualStack bool
		addrs     []string
		v4, v6    bool
	}{
		{false, nil, true, false},
		{true, nil, true, true}, // no address known: ISTIO_DUAL_STACK alone
		{false, []string{"10.1.2.3"}, true, false},
		{true, []string{"10.1.2.3"}, true, false},
		{false, []string{"fd00::5"}, false, true},
		{true, []string{"fd00::5"}, false, true},
		{false, []string{"10.1.2.3", "fd00::5"}, true, false}, // single-stack proxy: Istio writes no IPv6 rule
		{true, []string{"10.1.2.3", "fd00::5"}, true, true},
		{false, []string{"::ffff:10.1.2.3"}, true, false},
		{false, []string{"fe80::5"}, true, false}, // no family Istio captures: IPv4 rules, as Istio always writes them
	} {
		s := spec.PodDefaults()
		s.EnableIPv6 = tt.dualStack
		var as []netip.Addr
		for _, a := range tt.addrs {
			as = append(as, netip.MustParseAddr(a))
		}
		WithFamilies(&s, as)
		if s.EnableIPv4 != tt.v4 || s.EnableIPv6 != tt.v6 {
			t.Errorf("dual stack %v, %v: v4=%v v6=%v, want %v %v", tt.dualStack, tt.addrs, s.EnableIPv4, s.EnableIPv6, tt.v4, tt.v6)
		}
	}
}

// TestConfigIPv6: the pod's meshcni.io/ipv6 annotation wins over the node's mode
// (the plugin's ipv6 key), which wins over istio.
func TestConfigIPv6(t *testing.T) {
	for _, tt := range []struct {
		node spec.IPv6Mode
		pod  *Pod
		want spec.IPv6Mode
	}{
		{"", meshedPod(), spec.IPv6Istio},
		{spec.IPv6Drop, meshedPod(), spec.IPv6Drop},
		{spec.IPv6Capture, meshedPod(), spec.IPv6Capture},
		{spec.IPv6Drop, meshedPod(ann(AnnotationIPv6, "istio")), spec.IPv6Istio},
		{"", meshedPod(ann(AnnotationIPv6, "capture")), spec.IPv6Capture},
	} {
		addrs := []netip.Addr{netip.MustParseAddr("10.1.2.3"), netip.MustParseAddr("fd00::5")}
		r, err := Config{IPv6: tt.node}.ForPod(tt.pod, addrs)
		if err != nil {
			t.Fatal(err)
		}
		if r.Spec.IPv6 != tt.want || r.Spec.EnableIPv6 {
			t.Errorf("node %q, annotations %v: IPv6 %q EnableIPv6 %v, want %q false", tt.node, tt.pod.Annotations, r.Spec.IPv6, r.Spec.EnableIPv6, tt.want)
		}
	}
}

func TestParseLabel(t *testing.T) {
	l, err := ParseLabel(" app = meshcni ")
	if err != nil || l != (Label{"app", "meshcni"}) {
		t.Fatalf("got %v %v", l, err)
	}
	if !(Label{Key: "app"}).Matches(map[string]string{"app": "x"}) {
		t.Fatal("bare key should match any value")
	}
	for _, bad := range []string{"", "=x", "a b=c", "a=b=c"} {
		if _, err := ParseLabel(bad); err == nil {
			t.Errorf("ParseLabel(%q): no error", bad)
		}
	}
}

// TestSpecExcludePortZero: excludeOutboundPorts/excludeInboundPorts "0" is a no-op,
// as in Istio, not a failed ADD.
func TestSpecExcludePortZero(t *testing.T) {
	s, err := Spec(meshedPod(ann(AnnotationExcludeOutboundPorts, "0"), ann(AnnotationExcludeInboundPorts, "0")))
	if err != nil {
		t.Fatal(err)
	}
	if len(s.OutboundPortsExclude) != 0 {
		t.Errorf("OutboundPortsExclude %v, want none", s.OutboundPortsExclude)
	}
	if want := []uint16{15020, 15021, 15090}; !reflect.DeepEqual(s.InboundPortsExclude, want) {
		t.Errorf("InboundPortsExclude %v, want only the always-excluded %v", s.InboundPortsExclude, want)
	}
}
