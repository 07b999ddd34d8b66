// Package kubeget reads objects from the Kubernetes API server with plain GETs
// through client-go's authenticated transport (client certificates, tokens, exec
// plugins), for meshcnictl: the typed clientsets would double the binary's size.
package kubeget

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"path/filepath"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// maxBody bounds an answer read into memory.
const maxBody = 64 << 20

// Client GETs from one API server.
type Client struct {
	http *http.Client
	base *url.URL
}

// StatusError is an answer other than 200 OK.
type StatusError struct {
	Path   string
	Code   int
	Status string
	// Message is the API server's metav1.Status message, else the body.
	Message string
}

func (e *StatusError) Error() string {
	return fmt.Sprintf("GET %s: %s: %s", e.Path, e.Status, e.Message)
}

// IsNotFound reports whether err is a 404 answer (an object, or a resource the
// server does not serve).
func IsNotFound(err error) bool {
	var se *StatusError
	return errors.As(err, &se) && se.Code == http.StatusNotFound
}

// ClientConfig is the client configuration of a kubeconfig: the file (or a
// KUBECONFIG-style list, merged as kubectl does), else, when kubeconfig is empty,
// the in-cluster service account.
func ClientConfig(kubeconfig string) clientcmd.ClientConfig {
	rules := &clientcmd.ClientConfigLoadingRules{ExplicitPath: kubeconfig}
	if paths := filepath.SplitList(kubeconfig); len(paths) > 1 {
		rules = &clientcmd.ClientConfigLoadingRules{Precedence: paths}
	}
	return clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{})
}

// Namespace is the namespace of the kubeconfig's current context ("default" when it
// names none), or in a pod without kubeconfig, the service account's namespace.
func Namespace(kubeconfig string) (string, error) {
	if kubeconfig == "" {
		if _, err := rest.InClusterConfig(); err != nil {
			return "default", nil
		}
	}
	ns, _, err := ClientConfig(kubeconfig).Namespace()
	if err != nil {
		return "", fmt.Errorf("kubeconfig %s: namespace of the current context: %w", kubeconfig, err)
	}
	return ns, nil
}

// New returns a client for the kubeconfig (see ClientConfig).
func New(kubeconfig string) (*Client, error) {
	var cfg *rest.Config
	var err error
	if kubeconfig != "" {
		if cfg, err = ClientConfig(kubeconfig).ClientConfig(); err != nil {
			return nil, fmt.Errorf("kubeconfig %s: %w", kubeconfig, err)
		}
	} else if cfg, err = rest.InClusterConfig(); err != nil {
		return nil, fmt.Errorf("give --kubeconfig (or KUBECONFIG): no in-cluster service account (%w)", err)
	}
	return ForConfig(cfg)
}

// ForConfig returns a client for a rest.Config.
func ForConfig(cfg *rest.Config) (*Client, error) {
	hc, err := rest.HTTPClientFor(cfg)
	if err != nil {
		return nil, fmt.Errorf("API client: %w", err)
	}
	base, err := url.Parse(cfg.Host)
	if err != nil || base.Host == "" {
		return nil, fmt.Errorf("API server address %q: not a URL", cfg.Host)
	}
	if base.Scheme == "" {
		base.Scheme = "https"
	}
	return &Client{http: hc, base: base.JoinPath(cfg.APIPath)}, nil
}

// Host is the API server's host:port.
func (c *Client) Host() string { return c.base.Host }

// Raw GETs path (e.g. "api/v1/namespaces/app/pods/web") with the query and returns
// the body of a 200 answer; any other answer is a *StatusError.
func (c *Client) Raw(ctx context.Context, path string, query url.Values) ([]byte, error) {
	u := c.base.JoinPath(path)
	u.RawQuery = query.Encode()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Accept", "application/json")
	req.Header.Set("User-Agent", "meshcnictl")
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, fmt.Errorf("GET %s: %w", path, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxBody))
	if err != nil {
		return nil, fmt.Errorf("GET %s: read the answer: %w", path, err)
	}
	if resp.StatusCode != http.StatusOK {
		var st metav1.Status
		msg := strings.TrimSpace(string(body))
		if json.Unmarshal(body, &st) == nil && st.Message != "" {
			msg = st.Message
		}
		return nil, &StatusError{Path: path, Code: resp.StatusCode, Status: resp.Status, Message: msg}
	}
	return body, nil
}

// Get GETs path and decodes the JSON answer into v.
func (c *Client) Get(ctx context.Context, path string, query url.Values, v any) error {
	body, err := c.Raw(ctx, path, query)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(body, v); err != nil {
		return fmt.Errorf("GET %s: parse the answer: %w", path, err)
	}
	return nil
}

// pageSize is the number of objects a List asks for per page.
const pageSize = 500

// List GETs every page of a list (path, e.g. "api/v1/pods") and returns its items.
func List[T any](ctx context.Context, c *Client, path string, query url.Values) ([]T, error) {
	q := url.Values{}
	for k, v := range query {
		q[k] = v
	}
	q.Set("limit", fmt.Sprint(pageSize))
	var all []T
	for {
		var page struct {
			Metadata metav1.ListMeta `json:"metadata"`
			Items    []T             `json:"items"`
		}
		if err := c.Get(ctx, path, q, &page); err != nil {
			return nil, err
		}
		all = append(all, page.Items...)
		if page.Metadata.Continue == "" {
			return all, nil
		}
		q.Set("continue", page.Metadata.Continue)
	}
}
