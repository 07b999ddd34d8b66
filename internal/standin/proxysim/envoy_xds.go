package proxysim

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

// The Envoy face speaks ADS (the aggregated discovery service, state of the world)
// the way Envoy starts it: one stream, CDS first, LDS once CDS is answered, each
// response ACKed (or NACKed) with its version and nonce. The messages are encoded
// here field by field (envoy.service.discovery.v3.DiscoveryRequest/Response,
// envoy.config.core.v3.Node) so that meshcni's module needs neither Envoy's protos
// nor go-control-plane; only the resources' type URLs and names are read.

// xDS type URLs.
const (
	TypeCluster  = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
	TypeListener = "type.googleapis.com/envoy.config.listener.v3.Listener"
	TypeSecret   = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
)

const (
	adsMethod = "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources"
	sdsMethod = "/envoy.service.secret.v3.SecretDiscoveryService/StreamSecrets"
)

// XDSNode is the node identity sent in the first request (from the bootstrap).
type XDSNode struct {
	ID       string         `json:"id"`
	Cluster  string         `json:"cluster"`
	Metadata map[string]any `json:"metadata"`
	Locality struct {
		Region  string `json:"region"`
		Zone    string `json:"zone"`
		SubZone string `json:"sub_zone"`
	} `json:"locality"`
}

// DiscoveryRequest is the part of envoy.service.discovery.v3.DiscoveryRequest the
// stand-in sends.
type DiscoveryRequest struct {
	VersionInfo   string
	Node          *XDSNode // first request only
	ResourceNames []string
	TypeURL       string
	ResponseNonce string
	ErrorMessage  string // a NACK: google.rpc.Status{code: INVALID_ARGUMENT, message}
}

// DiscoveryResponse is the part of envoy.service.discovery.v3.DiscoveryResponse the
// stand-in reads.
type DiscoveryResponse struct {
	VersionInfo string
	TypeURL     string
	Nonce       string
	// Resources are the type URL and name of each resource.
	Resources []XDSResource
}

// XDSResource is one resource of a response.
type XDSResource struct {
	TypeURL string
	Name    string
	// Value is the encoded resource.
	Value []byte `json:"-"`
}

// Marshal encodes the request.
func (r DiscoveryRequest) Marshal() ([]byte, error) {
	var b []byte
	if r.VersionInfo != "" {
		b = protowire.AppendTag(b, 1, protowire.BytesType)
		b = protowire.AppendString(b, r.VersionInfo)
	}
	if r.Node != nil {
		node, err := r.Node.marshal()
		if err != nil {
			return nil, err
		}
		b = protowire.AppendTag(b, 2, protowire.BytesType)
		b = protowire.AppendBytes(b, node)
	}
	for _, n := range r.ResourceNames {
		b = protowire.AppendTag(b, 3, protowire.BytesType)
		b = protowire.AppendString(b, n)
	}
	b = protowire.AppendTag(b, 4, protowire.BytesType)
	b = protowire.AppendString(b, r.TypeURL)
	if r.ResponseNonce != "" {
		b = protowire.AppendTag(b, 5, protowire.BytesType)
		b = protowire.AppendString(b, r.ResponseNonce)
	}
	if r.ErrorMessage != "" {
		var st []byte
		st = protowire.AppendTag(st, 1, protowire.VarintType)
		st = protowire.AppendVarint(st, 3) // INVALID_ARGUMENT
		st = protowire.AppendTag(st, 2, protowire.BytesType)
		st = protowire.AppendString(st, r.ErrorMessage)
		b = protowire.AppendTag(b, 6, protowire.BytesType)
		b = protowire.AppendBytes(b, st)
	}
	return b, nil
}

// marshal encodes envoy.config.core.v3.Node: id 1, cluster 2, metadata 3
// (google.protobuf.Struct), locality 4, user_agent_name 6, user_agent_version 7.
func (n *XDSNode) marshal() ([]byte, error) {
	var b []byte
	b = protowire.AppendTag(b, 1, protowire.BytesType)
	b = protowire.AppendString(b, n.ID)
	b = protowire.AppendTag(b, 2, protowire.BytesType)
	b = protowire.AppendString(b, n.Cluster)
	if len(n.Metadata) > 0 {
		st, err := structpb.NewStruct(n.Metadata)
		if err != nil {
			return nil, fmt.Errorf("node metadata: %w", err)
		}
		mb, err := proto.Marshal(st)
		if err != nil {
			return nil, fmt.Errorf("node metadata: %w", err)
		}
		b = protowire.AppendTag(b, 3, protowire.BytesType)
		b = protowire.AppendBytes(b, mb)
	}
	var loc []byte
	for i, s := range []string{n.Locality.Region, n.Locality.Zone, n.Locality.SubZone} {
		if s != "" {
			loc = protowire.AppendTag(loc, protowire.Number(i+1), protowire.BytesType)
			loc = protowire.AppendString(loc, s)
		}
	}
	if len(loc) > 0 {
		b = protowire.AppendTag(b, 4, protowire.BytesType)
		b = protowire.AppendBytes(b, loc)
	}
	b = protowire.AppendTag(b, 6, protowire.BytesType)
	b = protowire.AppendString(b, "envoy")
	b = protowire.AppendTag(b, 7, protowire.BytesType)
	b = protowire.AppendString(b, "meshcni-envoy-standin")
	return b, nil
}

// ParseDiscoveryResponse decodes a response: version_info 1, resources 2 (repeated
// google.protobuf.Any: type_url 1, value 2), type_url 4, nonce 5. Each resource's
// name is field 1 of the resource (Cluster.name, Listener.name).
func ParseDiscoveryResponse(b []byte) (DiscoveryResponse, error) {
	var r DiscoveryResponse
	err := walkFields(b, func(num protowire.Number, v []byte) error {
		switch num {
		case 1:
			r.VersionInfo = string(v)
		case 2:
			res, err := parseAny(v)
			if err != nil {
				return fmt.Errorf("resource %d: %w", len(r.Resources), err)
			}
			r.Resources = append(r.Resources, res)
		case 4:
			r.TypeURL = string(v)
		case 5:
			r.Nonce = string(v)
		}
		return nil
	})
	if err != nil {
		return DiscoveryResponse{}, fmt.Errorf("decode DiscoveryResponse: %w", err)
	}
	return r, nil
}

func parseAny(b []byte) (XDSResource, error) {
	var res XDSResource
	var value []byte
	err := walkFields(b, func(num protowire.Number, v []byte) error {
		switch num {
		case 1:
			res.TypeURL = string(v)
		case 2:
			value = v
		}
		return nil
	})
	if err != nil {
		return res, err
	}
	res.Value = value
	err = walkFields(value, func(num protowire.Number, v []byte) error {
		if num == 1 && res.Name == "" {
			res.Name = string(v)
		}
		return nil
	})
	return res, err
}

// walkFields calls fn for every length-delimited field of b and skips the others.
func walkFields(b []byte, fn func(protowire.Number, []byte) error) error {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		if typ != protowire.BytesType {
			n = protowire.ConsumeFieldValue(num, typ, b)
			if n < 0 {
				return protowire.ParseError(n)
			}
			b = b[n:]
			continue
		}
		v, n := protowire.ConsumeBytes(b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		if err := fn(num, v); err != nil {
			return err
		}
		b = b[n:]
	}
	return nil
}

// Check says whether Envoy would accept the response for the type it asked for:
// the response's type URL and every resource's must match, and every resource needs a
// name. A non-nil error is sent back as a NACK.
func (r DiscoveryResponse) Check(want string) error {
	if r.TypeURL != want {
		return fmt.Errorf("response type %q, want %q", r.TypeURL, want)
	}
	var bad []string
	for i, res := range r.Resources {
		switch {
		case res.TypeURL != want:
			bad = append(bad, fmt.Sprintf("resource %d has type %q", i, res.TypeURL))
		case res.Name == "":
			bad = append(bad, fmt.Sprintf("resource %d has no name", i))
		}
	}
	if len(bad) > 0 {
		return errors.New(strings.Join(bad, "; "))
	}
	return nil
}

// rawCodec passes already encoded messages through gRPC.
type rawCodec struct{}

func (rawCodec) Marshal(v any) ([]byte, error) {
	b, ok := v.(*[]byte)
	if !ok {
		return nil, fmt.Errorf("rawCodec: cannot marshal %T", v)
	}
	return *b, nil
}

func (rawCodec) Unmarshal(data []byte, v any) error {
	b, ok := v.(*[]byte)
	if !ok {
		return fmt.Errorf("rawCodec: cannot unmarshal into %T", v)
	}
	*b = append((*b)[:0], data...)
	return nil
}

func (rawCodec) Name() string { return "proto" }

// ADSUpdate is one response the ADS client handled.
type ADSUpdate struct {
	Response DiscoveryResponse
	Err      error // non-nil: rejected (NACKed)
}

// xdsStream is one open discovery stream on a unix socket.
type xdsStream struct {
	conn   *grpc.ClientConn
	stream grpc.ClientStream
}

// openStream opens a stream on the unix socket at path (absolute: a gRPC target
// "unix://" + a relative path would read its first element as an authority).
func openStream(ctx context.Context, path, method string) (*xdsStream, error) {
	if !filepath.IsAbs(path) {
		return nil, fmt.Errorf("xDS socket %q is not an absolute path", path)
	}
	conn, err := grpc.NewClient("unix://"+path,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.ForceCodec(rawCodec{})))
	if err != nil {
		return nil, fmt.Errorf("xDS client for %s: %w", path, err)
	}
	stream, err := conn.NewStream(ctx, &grpc.StreamDesc{ServerStreams: true, ClientStreams: true}, method, grpc.WaitForReady(true))
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("xDS stream %s on %s: %w", method, path, err)
	}
	return &xdsStream{conn: conn, stream: stream}, nil
}

func (x *xdsStream) send(req DiscoveryRequest) error {
	b, err := req.Marshal()
	if err != nil {
		return err
	}
	if err := x.stream.SendMsg(&b); err != nil {
		return fmt.Errorf("xDS send %s: %w", req.TypeURL, err)
	}
	return nil
}

func (x *xdsStream) recv() ([]byte, error) {
	var b []byte
	if err := x.stream.RecvMsg(&b); err != nil {
		return nil, fmt.Errorf("xDS receive: %w", err)
	}
	return b, nil
}

// RunADS dials the ADS server on the unix socket path, asks for clusters, then (once
// clusters are answered) for listeners, ACKs or NACKs every response and reports each
// to onUpdate, until ctx is done or the stream fails.
func RunADS(ctx context.Context, path string, node XDSNode, onUpdate func(ADSUpdate)) error {
	askedLDS := false
	next := func(resp DiscoveryResponse) []DiscoveryRequest {
		if askedLDS || resp.TypeURL != TypeCluster {
			return nil
		}
		askedLDS = true
		return []DiscoveryRequest{{TypeURL: TypeListener}}
	}
	return runStream(ctx, path, adsMethod, DiscoveryRequest{Node: &node, TypeURL: TypeCluster},
		[]string{TypeCluster, TypeListener}, next, nil, onUpdate)
}

// RunSDS dials the SDS server on the unix socket path (pilot-agent's, which asks
// istiod to sign the workload certificate) and asks for the named secrets
// ("default": the workload certificate, "ROOTCA": the mesh's root), ACKing or
// NACKing every response, until ctx is done or the stream fails.
func RunSDS(ctx context.Context, path string, node XDSNode, names []string, onUpdate func(ADSUpdate)) error {
	return runStream(ctx, path, sdsMethod, DiscoveryRequest{Node: &node, TypeURL: TypeSecret, ResourceNames: names},
		[]string{TypeSecret}, nil, func(r XDSResource) error {
			_, err := ParseSecretCert(r.Value)
			return err
		}, onUpdate)
}

// runStream sends first, then ACKs (or NACKs) every response of the wanted types,
// repeating the resource names as Envoy does; next may add requests after a
// response, validate (optional) checks each resource.
func runStream(ctx context.Context, path, method string, first DiscoveryRequest, want []string,
	next func(DiscoveryResponse) []DiscoveryRequest, validate func(XDSResource) error, onUpdate func(ADSUpdate)) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	x, err := openStream(ctx, path, method)
	if err != nil {
		return err
	}
	defer x.conn.Close()
	if err := x.send(first); err != nil {
		return err
	}
	// accepted holds the last accepted version per type.
	accepted := map[string]string{}
	for {
		b, err := x.recv()
		if err != nil {
			return err
		}
		resp, err := ParseDiscoveryResponse(b)
		if err == nil {
			err = resp.Check(resp.TypeURL)
		}
		if err == nil && !slices.Contains(want, resp.TypeURL) {
			err = fmt.Errorf("unrequested type %q", resp.TypeURL)
		}
		for _, r := range resp.Resources {
			if err == nil && validate != nil {
				if verr := validate(r); verr != nil {
					err = fmt.Errorf("resource %s: %w", r.Name, verr)
				}
			}
		}
		onUpdate(ADSUpdate{Response: resp, Err: err})
		ack := DiscoveryRequest{TypeURL: resp.TypeURL, ResponseNonce: resp.Nonce, VersionInfo: resp.VersionInfo}
		if resp.TypeURL == first.TypeURL {
			ack.ResourceNames = first.ResourceNames
		}
		if err != nil {
			ack.VersionInfo = accepted[resp.TypeURL]
			ack.ErrorMessage = err.Error()
		} else {
			accepted[resp.TypeURL] = resp.VersionInfo
		}
		if resp.TypeURL != "" {
			if err := x.send(ack); err != nil {
				return err
			}
		}
		if next == nil {
			continue
		}
		for _, req := range next(resp) {
			if err := x.send(req); err != nil {
				return err
			}
		}
	}
}

// SecretCert is what the stand-in reads of an SDS secret
// (envoy.extensions.transport_sockets.tls.v3.Secret): the first certificate of the
// tls_certificate's chain (field 2, certificate_chain 1) or of the validation
// context's trusted CA (field 4, trusted_ca 1), each an inline DataSource.
type SecretCert struct {
	Kind     string // "tls_certificate" or "validation_context"
	URIs     []string
	Subject  string
	NotAfter time.Time
}

// ParseSecretCert decodes a Secret resource's value and its first certificate.
func ParseSecretCert(value []byte) (SecretCert, error) {
	var sc SecretCert
	var source []byte
	err := walkFields(value, func(num protowire.Number, v []byte) error {
		if num != 2 && num != 4 {
			return nil
		}
		sc.Kind = map[protowire.Number]string{2: "tls_certificate", 4: "validation_context"}[num]
		return walkFields(v, func(n protowire.Number, ds []byte) error {
			if n == 1 {
				source = ds
			}
			return nil
		})
	})
	if err != nil {
		return sc, fmt.Errorf("decode Secret: %w", err)
	}
	var pemBytes []byte
	err = walkFields(source, func(n protowire.Number, v []byte) error {
		if n == 2 || n == 3 { // inline_bytes, inline_string
			pemBytes = v
		}
		return nil
	})
	if err != nil || len(pemBytes) == 0 {
		return sc, fmt.Errorf("secret has no inline certificate (%v)", err)
	}
	blk, _ := pem.Decode(pemBytes)
	if blk == nil {
		return sc, errors.New("secret certificate is not PEM")
	}
	cert, err := x509.ParseCertificate(blk.Bytes)
	if err != nil {
		return sc, fmt.Errorf("secret certificate: %w", err)
	}
	for _, u := range cert.URIs {
		sc.URIs = append(sc.URIs, u.String())
	}
	sc.Subject, sc.NotAfter = cert.Subject.String(), cert.NotAfter
	return sc, nil
}
