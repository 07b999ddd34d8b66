package apiproxy

import (
	"bufio"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"k8s.io/client-go/rest"
)

// upstream counts the requests it got by path and streams lines on /watch?watch=true
// as the test sends them.
type upstream struct {
	got   map[string]*atomic.Int64
	lines chan string
}

func (u *upstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	u.got[r.URL.Path].Add(1)
	if r.URL.Query().Get("watch") != "true" {
		_, _ = io.WriteString(w, r.Method+" "+r.URL.Path)
		return
	}
	w.(http.Flusher).Flush()
	for {
		select {
		case l := <-u.lines:
			_, _ = io.WriteString(w, l+"\n")
			w.(http.Flusher).Flush()
		case <-r.Context().Done():
			return
		}
	}
}

func start(t *testing.T) (*Proxy, *upstream, *http.Client) {
	t.Helper()
	u := &upstream{got: map[string]*atomic.Int64{"/r": {}, "/w": {}, "/watch": {}}, lines: make(chan string)}
	srv := httptest.NewServer(u)
	t.Cleanup(srv.Close)
	p, err := Start(&rest.Config{Host: srv.URL})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	c, err := rest.HTTPClientFor(p.Config())
	if err != nil {
		t.Fatal(err)
	}
	return p, u, c
}

func pending(t *testing.T, ch <-chan string, what string) {
	t.Helper()
	select {
	case r := <-ch:
		t.Fatalf("%s answered %q during the fault", what, r)
	case <-time.After(100 * time.Millisecond):
	}
}

func TestProxy(t *testing.T) {
	p, u, c := start(t)
	base := p.Config().Host
	do := func(method, path string) <-chan string {
		out := make(chan string, 1)
		go func() {
			req, _ := http.NewRequest(method, base+path, nil)
			resp, err := c.Do(req)
			if err != nil {
				out <- "error"
				return
			}
			resp.Body.Close()
			out <- resp.Status
		}()
		return out
	}
	if r := <-do(http.MethodGet, "/r"); r != "200 OK" {
		t.Fatalf("pass: %q", r)
	}

	// A partition holds a request and never forwards it: at Heal the client's stream is reset.
	p.Partition()
	held := do(http.MethodGet, "/r")
	pending(t, held, "a request in a partition")
	p.Heal()
	if r := <-held; r != "error" {
		t.Errorf("a request held by a partition: %q at Heal, want an error", r)
	}
	if n := u.got["/r"].Load(); n != 1 {
		t.Errorf("upstream got %d requests on /r, want only the first", n)
	}

	// HoldWrites holds writes under the prefix and forwards them at Heal; reads pass.
	p.HoldWrites("/w")
	write := do(http.MethodPatch, "/w")
	pending(t, write, "a held write")
	if r := <-do(http.MethodGet, "/r"); r != "200 OK" {
		t.Errorf("a read while writes are held: %q", r)
	}
	if n := u.got["/w"].Load(); n != 0 {
		t.Fatalf("upstream got the held write")
	}
	p.Heal()
	if r := <-write; r != "200 OK" || u.got["/w"].Load() != 1 {
		t.Errorf("the held write at Heal: %q, upstream got %d", r, u.got["/w"].Load())
	}

	// StallWatches holds what a watch streams until Heal.
	resp, err := c.Get(base + "/watch?watch=true")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	lines := make(chan string)
	go func() {
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	u.lines <- "one"
	if l := <-lines; l != "one" {
		t.Fatalf("watch: %q", l)
	}
	p.StallWatches()
	u.lines <- "two"
	pending(t, lines, "a stalled watch")
	p.Heal()
	if l := <-lines; l != "two" {
		t.Errorf("watch after Heal: %q", l)
	}

	var log []string
	for _, r := range p.Requests() {
		log = append(log, r.Method+" "+r.Path+" "+map[bool]string{true: "dropped", false: "forwarded"}[r.Dropped])
	}
	want := "GET /r forwarded,GET /r dropped,PATCH /w forwarded,GET /r forwarded,GET /watch forwarded"
	if strings.Join(log, ",") != want {
		t.Errorf("log %q, want %q", strings.Join(log, ","), want)
	}
	if ws := Writes(p.Requests(), "/w"); len(ws) != 1 || ws[0].Status != 200 || !ws[0].Forwarded.After(ws[0].Received) {
		t.Errorf("Writes: %+v", ws)
	}
}
