package testbed

import (
	"context"
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
)

// controlSocket is where a shared test bed's owner (`hack/testbed up`) takes
// node requests: processes attached to it (`hack/testbed node add`, tests using
// Attach) cannot own a node's daemons themselves.
var controlSocket = filepath.Join(RunDir, "control.sock")

// serveControl answers POST /nodes/add?name=N and POST /nodes/remove?name=N.
func serveControl(tb *Testbed) (io.Closer, error) {
	_ = os.Remove(controlSocket)
	ln, err := net.Listen("unix", controlSocket)
	if err != nil {
		return nil, fmt.Errorf("control socket: %w", err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /nodes/add", func(w http.ResponseWriter, r *http.Request) {
		labels, err := parseLabelList(r.URL.Query().Get("labels"))
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		n, err := tb.AddNodeWith(r.Context(), r.URL.Query().Get("name"), NodeOptions{Labels: labels})
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		_ = json.NewEncoder(w).Encode(n.state())
	})
	mux.HandleFunc("POST /nodes/remove", func(w http.ResponseWriter, r *http.Request) {
		n, err := tb.Node(r.URL.Query().Get("name"))
		if err == nil {
			err = n.Remove(r.Context())
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	return srv, nil
}

// parseLabelList reads labelList's k=v,k=v ("" = none).
func parseLabelList(s string) (map[string]string, error) {
	if s == "" {
		return nil, nil
	}
	out := map[string]string{}
	for kv := range strings.SplitSeq(s, ",") {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("node label %q: want KEY=VALUE", kv)
		}
		out[k] = v
	}
	return out, nil
}

func controlCall(ctx context.Context, op, name string, query ...string) ([]byte, error) {
	c := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", controlSocket)
	}}}
	q := url.Values{"name": {name}}
	for i := 0; i+1 < len(query); i += 2 {
		q.Set(query[i], query[i+1])
	}
	u := "http://testbed/nodes/" + op + "?" + q.Encode()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, u, nil)
	if err != nil {
		return nil, err
	}
	resp, err := c.Do(req)
	if err != nil {
		return nil, fmt.Errorf("ask the test bed's owner (%s): %w", controlSocket, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode/100 != 2 {
		return nil, errors.New(strings.TrimSpace(string(b)))
	}
	return b, nil
}

func controlAddNode(ctx context.Context, tb *Testbed, name string, labels map[string]string) (*Node, error) {
	var query []string
	if len(labels) > 0 {
		query = []string{"labels", labelList(labels)}
	}
	b, err := controlCall(ctx, "add", name, query...)
	if err != nil {
		return nil, fmt.Errorf("add node %s: %w", name, err)
	}
	var s nodeState
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, fmt.Errorf("add node %s: %w", name, err)
	}
	return s.node(tb), nil
}

func controlRemoveNode(ctx context.Context, name string) error {
	if _, err := controlCall(ctx, "remove", name); err != nil {
		return fmt.Errorf("remove node %s: %w", name, err)
	}
	return nil
}
