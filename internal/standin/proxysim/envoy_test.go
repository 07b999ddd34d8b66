package proxysim_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"math/big"
	"net"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/encoding/protowire"

	"github.com/meshcni/meshcni/internal/standin/proxysim"
)

// The command line pilot-agent writes (pkg/envoy/proxy.go args() of the pinned Istio,
// with the sidecar's defaults).
var pilotAgentArgs = []string{
	"-c", "etc/istio/proxy/envoy-rev.json", "--drain-time-s", "45", "--drain-strategy", "immediate",
	"--local-address-ip-version", "v4", "--file-flush-interval-msec", "1000", "--disable-hot-restart",
	"--allow-unknown-static-fields", "-l", "warning", "--component-log-level", "misc:error", "--skip-deprecated-logs",
}

func TestParseEnvoyArgs(t *testing.T) {
	a, err := proxysim.ParseEnvoyArgs(pilotAgentArgs)
	if err != nil {
		t.Fatal(err)
	}
	if a.ConfigPath != "etc/istio/proxy/envoy-rev.json" || a.DrainTime != 45*time.Second || a.IPVersion != "v4" || a.LogLevel != "warning" {
		t.Errorf("parsed %+v", a)
	}
	bad := map[string][]string{
		"no -c":          {"--drain-time-s", "45"},
		"unknown flag":   {"-c", "x.json", "--no-such-flag"},
		"bad drain":      {"-c", "x.json", "--drain-time-s", "soon"},
		"bad ip version": {"-c", "x.json", "--local-address-ip-version", "v5"},
		"stray argument": {"-c", "x.json", "extra"},
	}
	for name, args := range bad {
		if _, err := proxysim.ParseEnvoyArgs(args); err == nil {
			t.Errorf("%s: %q accepted", name, args)
		}
	}
}

// TestParseRealBootstrap reads the envoy-rev.json pilot-agent (the pinned Istio)
// rendered in a pod injected by istiod on the test bed.
func TestParseRealBootstrap(t *testing.T) {
	b, err := os.ReadFile("testdata/envoy-rev.json")
	if err != nil {
		t.Fatal(err)
	}
	bs, err := proxysim.ParseBootstrap(b)
	if err != nil {
		t.Fatal(err)
	}
	if bs.Admin.String() != "127.0.0.1:15000" || bs.XDSPath != "./etc/istio/proxy/XDS" || bs.SDSPath != "./var/run/secrets/workload-spiffe-uds/socket" ||
		bs.Health.String() != "0.0.0.0:15021" || bs.Agent.String() != "127.0.0.1:15020" {
		t.Errorf("parsed %+v", bs)
	}
	if !strings.HasPrefix(bs.Node.ID, "sidecar~10.213.0.3~server-") || bs.Node.Metadata["NAMESPACE"] != "istio-e2e" {
		t.Errorf("node %s, metadata NAMESPACE %v", bs.Node.ID, bs.Node.Metadata["NAMESPACE"])
	}
}

func TestParseBootstrap(t *testing.T) {
	b, err := os.ReadFile("testdata/envoy-rev-min.json")
	if err != nil {
		t.Fatal(err)
	}
	bs, err := proxysim.ParseBootstrap(b)
	if err != nil {
		t.Fatal(err)
	}
	want := proxysim.Bootstrap{
		Admin:   netip.MustParseAddrPort("127.0.0.1:15000"),
		XDSPath: "./etc/istio/proxy/XDS", SDSPath: "./var/run/secrets/workload-spiffe-uds/socket",
		Health: netip.MustParseAddrPort("0.0.0.0:15021"), Agent: netip.MustParseAddrPort("127.0.0.1:15020"),
	}
	if bs.Admin != want.Admin || bs.XDSPath != want.XDSPath || bs.SDSPath != want.SDSPath || bs.Health != want.Health || bs.Agent != want.Agent {
		t.Errorf("got %+v\nwant %+v", bs, want)
	}
	if bs.Node.ID != "sidecar~10.213.0.9~client-7d9f.istio-e2e~istio-e2e.svc.cluster.local" || bs.Node.Metadata["NAMESPACE"] != "istio-e2e" {
		t.Errorf("node %+v", bs.Node)
	}
	// gRPC reads "unix://./etc/…" as an authority: the sockets are resolved to
	// absolute paths against Envoy's working directory.
	if got := proxysim.Abs("/", bs.XDSPath); got != "/etc/istio/proxy/XDS" {
		t.Errorf("Abs(/, %s) = %s", bs.XDSPath, got)
	}
	if got := proxysim.Abs("", bs.XDSPath); !filepath.IsAbs(got) {
		t.Errorf("Abs(\"\", %s) = %s, not absolute", bs.XDSPath, got)
	}
	for _, cut := range []string{`"id": "sidecar~10.213.0.9~client-7d9f.istio-e2e~istio-e2e.svc.cluster.local"`, `"prefix": "/healthz/ready"`, `"name": "xds-grpc"`} {
		broken := strings.Replace(string(b), cut, `"x": 1`, 1)
		if _, err := proxysim.ParseBootstrap([]byte(broken)); err == nil {
			t.Errorf("bootstrap without %s accepted", cut)
		}
	}
}

// readiness parses /stats text the way pilot-agent's status/util does: the first
// line starting with the stat's name, "name: value".
func readiness(text, name string) (uint64, bool) {
	for _, line := range strings.Split(text, "\n") {
		if strings.HasPrefix(line, name) {
			_, v, _ := strings.Cut(line, ":")
			n, err := strconv.ParseUint(strings.TrimSpace(v), 10, 64)
			return n, err == nil
		}
	}
	return 0, false
}

// pilot-agent's filters (status/util/stats.go).
var (
	readyFilter  = regexp.MustCompile(`^(server\.state|listener_manager\.workers_started)`)
	updateFilter = regexp.MustCompile(`^(cluster_manager\.cds|listener_manager\.lds)\.(update_success|update_rejected)$`)
)

func TestEnvoyStatsText(t *testing.T) {
	s := proxysim.NewEnvoyStats()
	if v, ok := readiness(s.Text(readyFilter), "server.state"); !ok || v != 2 {
		t.Errorf("fresh server.state = %d, %v; want 2 (PRE_INITIALIZING)", v, ok)
	}
	if _, ok := readiness(s.Text(updateFilter), "cluster_manager.cds.update_success"); ok {
		t.Error("an unused counter is listed")
	}
	s.Add(proxysim.StatCDSSuccess, 1)
	s.Add(proxysim.StatCDSSuccess, 1)
	s.Set(proxysim.StatServerState, 0)
	got := s.Text(updateFilter)
	if got != "cluster_manager.cds.update_success: 2\n" {
		t.Errorf("update stats %q", got)
	}
	if strings.Contains(s.Text(updateFilter), "server.state") {
		t.Error("filter ignored")
	}
}

// rawCodec and a fake ADS server: pure protocol logic; the proof against istiod is
// the e2e test in internal/env/istio/e2e.
type rawCodec struct{}

func (rawCodec) Marshal(v any) ([]byte, error) { return *(v.(*[]byte)), nil }
func (rawCodec) Unmarshal(d []byte, v any) error {
	*(v.(*[]byte)) = append([]byte(nil), d...)
	return nil
}
func (rawCodec) Name() string { return "proto" }

func str(b []byte, num protowire.Number, s string) []byte {
	b = protowire.AppendTag(b, num, protowire.BytesType)
	return protowire.AppendString(b, s)
}

func msg(b []byte, num protowire.Number, m []byte) []byte {
	b = protowire.AppendTag(b, num, protowire.BytesType)
	return protowire.AppendBytes(b, m)
}

// response encodes a DiscoveryResponse by hand, each resource an Any whose value's
// field 1 is the name.
func response(typeURL, version, nonce string, resType string, names ...string) []byte {
	var b []byte
	b = str(b, 1, version)
	for _, n := range names {
		var any []byte
		any = str(any, 1, resType)
		any = msg(any, 2, str(nil, 1, n))
		b = msg(b, 2, any)
	}
	b = str(b, 4, typeURL)
	return str(b, 5, nonce)
}

// request is what the fake server reads of a DiscoveryRequest.
type request struct {
	version, typeURL, nonce, nodeID, errMsg string
}

func parseRequest(t *testing.T, b []byte) request {
	var r request
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 || typ != protowire.BytesType {
			t.Fatalf("request: field %d type %v", num, typ)
		}
		b = b[n:]
		v, n := protowire.ConsumeBytes(b)
		b = b[n:]
		switch num {
		case 1:
			r.version = string(v)
		case 2:
			_, _, n := protowire.ConsumeTag(v)
			id, _ := protowire.ConsumeBytes(v[n:])
			r.nodeID = string(id)
		case 4:
			r.typeURL = string(v)
		case 5:
			r.nonce = string(v)
		case 6:
			r.errMsg = string(v)
		}
	}
	return r
}

func TestRunADS(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "XDS")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var seen []request
	srv := grpc.NewServer(grpc.ForceServerCodec(rawCodec{}), grpc.UnknownServiceHandler(func(_ any, st grpc.ServerStream) error {
		recv := func() request {
			var b []byte
			if err := st.RecvMsg(&b); err != nil {
				panic(err)
			}
			r := parseRequest(t, b)
			mu.Lock()
			seen = append(seen, r)
			mu.Unlock()
			return r
		}
		send := func(b []byte) { _ = st.SendMsg(&b) }
		recv() // CDS request with the node
		send(response(proxysim.TypeCluster, "v1", "n1", proxysim.TypeCluster, "outbound|80||a", "BlackHoleCluster"))
		recv()                                                                                     // ACK
		recv()                                                                                     // LDS request
		send(response(proxysim.TypeListener, "v1", "n2", proxysim.TypeCluster, "virtualOutbound")) // wrong resource type
		recv()                                                                                     // NACK
		send(response(proxysim.TypeListener, "v2", "n3", proxysim.TypeListener, "virtualOutbound", "virtualInbound"))
		recv() // ACK
		<-st.Context().Done()
		return nil
	}))
	go func() { _ = srv.Serve(ln) }()
	defer srv.Stop()

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var updates []proxysim.ADSUpdate
	err = proxysim.RunADS(ctx, sock, proxysim.XDSNode{ID: "sidecar~1", Metadata: map[string]any{"A": "b"}}, func(u proxysim.ADSUpdate) {
		updates = append(updates, u)
		if len(updates) == 3 {
			go func() { time.Sleep(100 * time.Millisecond); cancel() }()
		}
	})
	if err == nil || (!errors.Is(err, context.Canceled) && !strings.Contains(err.Error(), "Canceled")) {
		t.Fatalf("RunADS: %v", err)
	}
	if len(updates) != 3 || updates[0].Err != nil || updates[1].Err == nil || updates[2].Err != nil {
		t.Fatalf("updates %+v", updates)
	}
	if n := len(updates[2].Response.Resources); n != 2 || updates[2].Response.Resources[1].Name != "virtualInbound" {
		t.Errorf("LDS resources %+v", updates[2].Response.Resources)
	}
	mu.Lock()
	defer mu.Unlock()
	want := []request{
		{typeURL: proxysim.TypeCluster, nodeID: "sidecar~1"},
		{typeURL: proxysim.TypeCluster, version: "v1", nonce: "n1"},
		{typeURL: proxysim.TypeListener},
		{typeURL: proxysim.TypeListener, nonce: "n2"}, // NACK keeps the last accepted version (none)
		{typeURL: proxysim.TypeListener, version: "v2", nonce: "n3"},
	}
	if len(seen) != len(want) {
		t.Fatalf("requests %+v", seen)
	}
	for i := range want {
		got := seen[i]
		hasErr := got.errMsg != ""
		got.errMsg = ""
		if got != want[i] || hasErr != (i == 3) {
			t.Errorf("request %d = %+v (error detail %v), want %+v", i, seen[i], hasErr, want[i])
		}
	}
}

func TestParseSecretCert(t *testing.T) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	id, _ := url.Parse("spiffe://cluster.local/ns/istio-e2e/sa/default")
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), URIs: []*url.URL{id}, NotAfter: time.Now().Add(time.Hour).Truncate(time.Second)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	chain := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	// Secret{name: "default", tls_certificate: {certificate_chain: {inline_bytes: chain}}}
	var ds []byte
	ds = protowire.AppendTag(ds, 2, protowire.BytesType)
	ds = protowire.AppendBytes(ds, chain)
	secret := msg(str(nil, 1, "default"), 2, msg(nil, 1, ds))
	sc, err := proxysim.ParseSecretCert(secret)
	if err != nil {
		t.Fatal(err)
	}
	if sc.Kind != "tls_certificate" || len(sc.URIs) != 1 || sc.URIs[0] != id.String() || !sc.NotAfter.Equal(tmpl.NotAfter) {
		t.Errorf("got %+v", sc)
	}
	if _, err := proxysim.ParseSecretCert(str(nil, 1, "default")); err == nil {
		t.Error("a secret without a certificate was accepted")
	}
}
