// Package apiproxy puts a fault-injecting HTTPS proxy between one API client and a real
// kube-apiserver, for tests: it logs every request the client sends (method, path,
// when it arrived, when it was forwarded, the answer), and it can cut the client off
// (Partition), stall only its watch streams (StallWatches), delay its writes
// (HoldWrites), and Heal.
//
// The proxy ends the client's TLS with a certificate of its own and forwards each
// request with the upstream credentials, so it sees every request in clear: the
// requests one client (one process) sent are exactly those in its proxy's log.
//
// A partition is a lost network, not a slow one: a request held by it is never
// forwarded; at Heal it is aborted (the client sees a reset stream), as when the
// client's connection broke. HoldWrites is a slow one: the writes it holds are
// forwarded at Heal, as they were sent. Data the upstream sent during a fault is
// delivered at Heal, in order (a TCP connection that survived).
package apiproxy

import (
	"context"
	"encoding/pem"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"time"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// Request is one request the client sent, as the proxy saw it.
type Request struct {
	Method, Path, Query string
	UserAgent           string
	Watch               bool
	Received            time.Time // arrived at the proxy
	Forwarded           time.Time // sent upstream; zero if never (held, then dropped)
	Answered            time.Time // upstream's response headers came back
	Status              int       // upstream's status; 0 if none
	Dropped             bool      // held by a partition and never forwarded
}

// IsWrite reports whether the request changes something (POST, PUT, PATCH, DELETE).
func (r Request) IsWrite() bool {
	switch r.Method {
	case http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete:
		return true
	}
	return false
}

type mode int

const (
	pass mode = iota
	partitioned
	watchesStalled
	writesHeld
)

// Proxy is one client's proxy.
type Proxy struct {
	srv    *httptest.Server
	rp     *httputil.ReverseProxy
	mu     sync.Mutex
	mode   mode
	healed chan struct{} // closed by Heal
	hold   string        // writesHeld: the path prefix of the writes held
	reqs   []*Request
}

type recKey struct{}

// Start starts a proxy to the API server of upstream (whose credentials it uses).
func Start(upstream *rest.Config) (*Proxy, error) {
	target, err := url.Parse(upstream.Host)
	if err != nil {
		return nil, fmt.Errorf("apiproxy: upstream %q: %w", upstream.Host, err)
	}
	rt, err := rest.TransportFor(upstream)
	if err != nil {
		return nil, fmt.Errorf("apiproxy: upstream transport: %w", err)
	}
	p := &Proxy{healed: make(chan struct{})}
	p.rp = &httputil.ReverseProxy{
		Transport:     rt,
		FlushInterval: -1, // watch events go through at once
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(target)
			pr.Out.Header.Set("User-Agent", pr.In.Header.Get("User-Agent"))
			if rec, ok := pr.In.Context().Value(recKey{}).(*Request); ok {
				p.mu.Lock()
				rec.Forwarded = time.Now()
				p.mu.Unlock()
			}
		},
		ModifyResponse: func(resp *http.Response) error {
			rec, _ := resp.Request.Context().Value(recKey{}).(*Request)
			if rec != nil {
				p.mu.Lock()
				rec.Answered, rec.Status = time.Now(), resp.StatusCode
				p.mu.Unlock()
			}
			resp.Body = &gatedBody{ReadCloser: resp.Body, p: p, watch: rec != nil && rec.Watch, ctx: resp.Request.Context()}
			return nil
		},
	}
	p.srv = httptest.NewUnstartedServer(http.HandlerFunc(p.serve))
	p.srv.EnableHTTP2 = true
	p.srv.StartTLS()
	return p, nil
}

func (p *Proxy) serve(w http.ResponseWriter, r *http.Request) {
	rec := &Request{Method: r.Method, Path: r.URL.Path, Query: r.URL.RawQuery, UserAgent: r.UserAgent(),
		Watch: r.URL.Query().Get("watch") == "true" || r.URL.Query().Get("watch") == "1", Received: time.Now()}
	p.mu.Lock()
	p.reqs = append(p.reqs, rec)
	m, healed, hold := p.mode, p.healed, p.hold
	p.mu.Unlock()
	if m == writesHeld && rec.IsWrite() && strings.HasPrefix(rec.Path, hold) {
		select {
		case <-healed: // delivered late
		case <-r.Context().Done():
			p.mu.Lock()
			rec.Dropped = true
			p.mu.Unlock()
			return
		}
	}
	if m == partitioned {
		select {
		case <-healed:
		case <-r.Context().Done():
		}
		p.mu.Lock()
		rec.Dropped = true
		p.mu.Unlock()
		panic(http.ErrAbortHandler) // lost: the client sees its stream reset
	}
	p.rp.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), recKey{}, rec)))
}

// gatedBody holds what upstream sends while the client is cut off from it.
type gatedBody struct {
	io.ReadCloser
	p     *Proxy
	watch bool
	ctx   context.Context
}

func (b *gatedBody) Read(buf []byte) (int, error) {
	n, err := b.ReadCloser.Read(buf)
	for {
		b.p.mu.Lock()
		m, healed := b.p.mode, b.p.healed
		b.p.mu.Unlock()
		if m == pass || m == writesHeld || (m == watchesStalled && !b.watch) {
			return n, err
		}
		select {
		case <-healed:
		case <-b.ctx.Done():
			return 0, b.ctx.Err()
		}
	}
}

// Partition cuts the client off: new requests are held and never forwarded (aborted
// at Heal), and nothing upstream sends on open responses (watch events) reaches it
// until Heal.
func (p *Proxy) Partition() { p.fault(partitioned, "") }

// StallWatches stops the events of the client's watches (open and new) until Heal;
// every other request passes.
func (p *Proxy) StallWatches() { p.fault(watchesStalled, "") }

// HoldWrites holds the client's writes (POST, PUT, PATCH, DELETE) whose path starts
// with prefix until Heal, which forwards them; everything else passes. The client
// acts on what it read before; the API server gets its write only after the test has
// changed the object.
func (p *Proxy) HoldWrites(prefix string) {
	p.fault(writesHeld, prefix)
}

func (p *Proxy) fault(m mode, hold string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.mode != pass {
		close(p.healed)
		p.healed = make(chan struct{})
	}
	p.mode, p.hold = m, hold
}

// Heal ends a fault: requests held by a partition are aborted, writes held by
// HoldWrites are forwarded, held data is delivered.
func (p *Proxy) Heal() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.mode == pass {
		return
	}
	p.mode = pass
	close(p.healed)
	p.healed = make(chan struct{})
}

// Requests returns a copy of the log, in the order the requests arrived.
func (p *Proxy) Requests() []Request {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]Request, len(p.reqs))
	for i, r := range p.reqs {
		out[i] = *r
	}
	return out
}

// Config is a client configuration that talks to the API server through the proxy.
func (p *Proxy) Config() *rest.Config {
	return &rest.Config{Host: p.srv.URL, TLSClientConfig: rest.TLSClientConfig{CAData: p.caPEM()}}
}

func (p *Proxy) caPEM() []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: p.srv.Certificate().Raw})
}

// WriteKubeconfig writes a kubeconfig for a process to reach the API server through
// the proxy.
func (p *Proxy) WriteKubeconfig(path string) error {
	c := clientcmdapi.NewConfig()
	c.Clusters["proxy"] = &clientcmdapi.Cluster{Server: p.srv.URL, CertificateAuthorityData: p.caPEM()}
	c.AuthInfos["proxy"] = &clientcmdapi.AuthInfo{}
	c.Contexts["proxy"] = &clientcmdapi.Context{Cluster: "proxy", AuthInfo: "proxy"}
	c.CurrentContext = "proxy"
	if err := clientcmd.WriteToFile(*c, path); err != nil {
		return fmt.Errorf("apiproxy: kubeconfig: %w", err)
	}
	return nil
}

// Close stops the proxy.
func (p *Proxy) Close() {
	p.Heal()
	p.srv.CloseClientConnections()
	p.srv.Close()
}

// Writes returns the writes (POST, PUT, PATCH, DELETE) whose path starts with prefix.
func Writes(reqs []Request, prefix string) []Request {
	var out []Request
	for _, r := range reqs {
		if r.IsWrite() && strings.HasPrefix(r.Path, prefix) {
			out = append(out, r)
		}
	}
	return out
}
