// Package helper is the inside of meshcni-podget, the helper the CNI plugin runs when
// the node agent cannot answer its pod lookup: it GETs one pod from the Kubernetes API
// server with a kubeconfig, over plain net/http (no client-go: no clientsets, scheme
// registration or auth plugins). Its parent pkg/podget runs the helper and keeps this
// package and its TLS stack out of the plugin binary.
package helper

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/meshcni/meshcni/pkg/capture"
	"github.com/meshcni/meshcni/pkg/podget"
)

// The kubeconfig is the agent's (or the one the plugin's legacy kubernetes.kubeconfig
// names): one cluster, one user, with a bearer token (inline or tokenFile) or a client
// certificate, and a CA (inline or a file).

// kubeconfig is the subset of a kubeconfig file the plugin reads.
type kubeconfig struct {
	CurrentContext string `json:"current-context"`
	Clusters       []struct {
		Name    string `json:"name"`
		Cluster struct {
			Server                   string `json:"server"`
			CertificateAuthority     string `json:"certificate-authority"`
			CertificateAuthorityData string `json:"certificate-authority-data"`
			InsecureSkipTLSVerify    bool   `json:"insecure-skip-tls-verify"`
			TLSServerName            string `json:"tls-server-name"`
		} `json:"cluster"`
	} `json:"clusters"`
	Users []struct {
		Name string `json:"name"`
		User struct {
			Token                 string `json:"token"`
			TokenFile             string `json:"tokenFile"`
			ClientCertificate     string `json:"client-certificate"`
			ClientCertificateData string `json:"client-certificate-data"`
			ClientKey             string `json:"client-key"`
			ClientKeyData         string `json:"client-key-data"`
			Exec                  any    `json:"exec"`
			AuthProvider          any    `json:"auth-provider"`
		} `json:"user"`
	} `json:"users"`
	Contexts []struct {
		Name    string `json:"name"`
		Context struct {
			Cluster string `json:"cluster"`
			User    string `json:"user"`
		} `json:"context"`
	} `json:"contexts"`
}

// APIConfig is a resolved kubeconfig: where the API server is and how to talk to it.
type APIConfig struct {
	Server    *url.URL
	TLS       *tls.Config
	Token     string // bearer token ("" with client certificates)
	TokenFile string // re-read at each request when set (projected tokens rotate)
}

// LoadKubeconfig reads a kubeconfig file and resolves its current context (or its
// only context) into an APIConfig. Relative file paths in it are relative to the
// kubeconfig's directory, as kubectl resolves them.
func LoadKubeconfig(path string) (*APIConfig, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read kubeconfig: %w", err)
	}
	cfg, err := ParseKubeconfig(data, filepath.Dir(path))
	if err != nil {
		return nil, fmt.Errorf("kubeconfig %s: %w", path, err)
	}
	return cfg, nil
}

// ParseKubeconfig parses kubeconfig YAML; dir resolves relative file references.
func ParseKubeconfig(data []byte, dir string) (*APIConfig, error) {
	var kc kubeconfig
	if err := yaml.Unmarshal(data, &kc); err != nil {
		return nil, fmt.Errorf("parse: %w", err)
	}
	ctxName := kc.CurrentContext
	if ctxName == "" {
		if len(kc.Contexts) != 1 {
			return nil, fmt.Errorf("no current-context and %d contexts: cannot choose one", len(kc.Contexts))
		}
		ctxName = kc.Contexts[0].Name
	}
	var clusterName, userName string
	found := false
	for _, c := range kc.Contexts {
		if c.Name == ctxName {
			clusterName, userName, found = c.Context.Cluster, c.Context.User, true
			break
		}
	}
	if !found {
		return nil, fmt.Errorf("context %q not found", ctxName)
	}
	abs := func(p string) string {
		if p == "" || filepath.IsAbs(p) {
			return p
		}
		return filepath.Join(dir, p)
	}

	out := &APIConfig{TLS: &tls.Config{MinVersion: tls.VersionTLS12}}
	found = false
	for _, c := range kc.Clusters {
		if c.Name != clusterName {
			continue
		}
		found = true
		u, err := url.Parse(c.Cluster.Server)
		if err != nil || u.Host == "" || (u.Scheme != "https" && u.Scheme != "http") {
			return nil, fmt.Errorf("cluster %q: server %q is not an http(s) URL", clusterName, c.Cluster.Server)
		}
		out.Server = u
		out.TLS.ServerName = c.Cluster.TLSServerName
		out.TLS.InsecureSkipVerify = c.Cluster.InsecureSkipTLSVerify
		var caPEM []byte
		switch {
		case c.Cluster.CertificateAuthorityData != "":
			if caPEM, err = base64.StdEncoding.DecodeString(c.Cluster.CertificateAuthorityData); err != nil {
				return nil, fmt.Errorf("cluster %q: certificate-authority-data is not base64: %w", clusterName, err)
			}
		case c.Cluster.CertificateAuthority != "":
			if caPEM, err = os.ReadFile(abs(c.Cluster.CertificateAuthority)); err != nil {
				return nil, fmt.Errorf("cluster %q: certificate-authority: %w", clusterName, err)
			}
		}
		if len(caPEM) > 0 {
			pool := x509.NewCertPool()
			if !pool.AppendCertsFromPEM(caPEM) {
				return nil, fmt.Errorf("cluster %q: the certificate authority holds no PEM certificate", clusterName)
			}
			out.TLS.RootCAs = pool
		}
	}
	if !found {
		return nil, fmt.Errorf("cluster %q (of context %q) not found", clusterName, ctxName)
	}
	found = false
	for _, u := range kc.Users {
		if u.Name != userName {
			continue
		}
		found = true
		usr := u.User
		if usr.Exec != nil || usr.AuthProvider != nil {
			return nil, fmt.Errorf("user %q: exec and auth-provider credentials are not supported; use a token or a client certificate", userName)
		}
		out.Token = strings.TrimSpace(usr.Token)
		out.TokenFile = abs(usr.TokenFile)
		certPEM, err := pemOnly(usr.ClientCertificateData, abs(usr.ClientCertificate), "client-certificate")
		if err != nil {
			return nil, fmt.Errorf("user %q: %w", userName, err)
		}
		keyPEM, err := pemOnly(usr.ClientKeyData, abs(usr.ClientKey), "client-key")
		if err != nil {
			return nil, fmt.Errorf("user %q: %w", userName, err)
		}
		if len(certPEM) > 0 || len(keyPEM) > 0 {
			pair, err := tls.X509KeyPair(certPEM, keyPEM)
			if err != nil {
				return nil, fmt.Errorf("user %q: client certificate and key: %w", userName, err)
			}
			out.TLS.Certificates = []tls.Certificate{pair}
		}
	}
	if !found && userName != "" {
		return nil, fmt.Errorf("user %q (of context %q) not found", userName, ctxName)
	}
	if out.TokenFile != "" && out.Token == "" {
		if _, err := readToken(out.TokenFile); err != nil {
			return nil, err
		}
	}
	return out, nil
}

func pemOnly(data, file, what string) ([]byte, error) {
	switch {
	case data != "":
		b, err := base64.StdEncoding.DecodeString(data)
		if err != nil {
			return nil, fmt.Errorf("%s-data is not base64: %w", what, err)
		}
		return b, nil
	case file != "":
		b, err := os.ReadFile(file)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", what, err)
		}
		return b, nil
	}
	return nil, nil
}

func readToken(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("tokenFile: %w", err)
	}
	return strings.TrimSpace(string(b)), nil
}

// credentialError: the credentials the kubeconfig names cannot be read (a tokenFile
// that is gone or unreadable at request time).
type credentialError struct{ err error }

func (e *credentialError) Error() string { return e.err.Error() }
func (e *credentialError) Unwrap() error { return e.err }

// APIError is podget's: the helper reports it to the plugin field by field.
type APIError = podget.APIError

// PodClient GETs pods from the API server.
type PodClient struct {
	cfg    *APIConfig
	client *http.Client
	// Backoff is the first retry delay, doubled after each attempt up to MaxBackoff.
	Backoff, MaxBackoff time.Duration
	// AttemptTimeout bounds one request.
	AttemptTimeout time.Duration
}

// NewPodClient builds a client for cfg.
func NewPodClient(cfg *APIConfig) *PodClient {
	tr := &http.Transport{
		TLSClientConfig:     cfg.TLS,
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second}).DialContext,
		TLSHandshakeTimeout: 5 * time.Second,
		ForceAttemptHTTP2:   true,
		DisableCompression:  true,
	}
	return &PodClient{
		cfg:            cfg,
		client:         &http.Client{Transport: tr},
		Backoff:        100 * time.Millisecond,
		MaxBackoff:     2 * time.Second,
		AttemptTimeout: 10 * time.Second,
	}
}

// Server is the API server URL.
func (c *PodClient) Server() string { return c.cfg.Server.String() }

// GetPod GETs /api/v1/namespaces/NS/pods/NAME, retrying retryable failures with an
// exponential backoff until ctx ends. The last failure is returned as an *APIError.
func (c *PodClient) GetPod(ctx context.Context, namespace, name string) (*capture.Pod, error) {
	delay := c.Backoff
	for attempt := 1; ; attempt++ {
		pod, err := c.getOnce(ctx, namespace, name)
		if err == nil {
			return pod, nil
		}
		var ae *APIError
		if errors.As(err, &ae) {
			ae.Attempts = attempt
		}
		if ae == nil || !ae.Retryable() {
			return nil, err
		}
		t := time.NewTimer(delay)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, fmt.Errorf("after %d attempts: %w", attempt, err)
		case <-t.C:
		}
		if delay *= 2; delay > c.MaxBackoff {
			delay = c.MaxBackoff
		}
	}
}

func (c *PodClient) getOnce(ctx context.Context, namespace, name string) (*capture.Pod, error) {
	actx, cancel := context.WithTimeout(ctx, c.AttemptTimeout)
	defer cancel()
	u := *c.cfg.Server
	u.Path = strings.TrimRight(u.Path, "/") + "/api/v1/namespaces/" + url.PathEscape(namespace) + "/pods/" + url.PathEscape(name)
	req, err := http.NewRequestWithContext(actx, http.MethodGet, u.String(), nil)
	if err != nil {
		return nil, fmt.Errorf("build request: %w", err)
	}
	// JSON into capture.Pod, which holds only the fields meshcni reads: no k8s.io
	// package is linked (their package init would be paid by every exec of the
	// plugin), and the decoder skips the rest of the pod.
	req.Header.Set("Accept", "application/json")
	req.Header.Set("User-Agent", "meshcni-podget")
	token := c.cfg.Token
	if token == "" && c.cfg.TokenFile != "" {
		if token, err = readToken(c.cfg.TokenFile); err != nil {
			return nil, &credentialError{err}
		}
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	server := c.Server()
	resp, err := c.client.Do(req)
	if err != nil {
		return nil, &APIError{Server: server, Err: unwrapURLError(err)}
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 8<<20))
	if err != nil {
		return nil, &APIError{Server: server, Err: fmt.Errorf("read response: %w", err)}
	}
	if resp.StatusCode != http.StatusOK {
		return nil, &APIError{Server: server, Status: resp.StatusCode, Err: errors.New(statusMessage(body))}
	}
	var pod capture.Pod
	if err := json.Unmarshal(body, &pod); err != nil {
		return nil, fmt.Errorf("decode pod %s/%s from %s: %w", namespace, name, server, err)
	}
	return &pod, nil
}

// statusMessage extracts a Kubernetes Status message, or the start of the body.
func statusMessage(body []byte) string {
	var st struct {
		Message string `json:"message"`
	}
	if json.Unmarshal(body, &st) == nil && st.Message != "" {
		return st.Message
	}
	s := strings.TrimSpace(string(body))
	if len(s) > 200 {
		s = s[:200] + "..."
	}
	if s == "" {
		s = "empty response"
	}
	return s
}

func unwrapURLError(err error) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		return ue.Err
	}
	return err
}
