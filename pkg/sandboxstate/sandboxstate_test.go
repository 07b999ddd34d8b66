package sandboxstate_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/meshcni/meshcni/pkg/sandboxstate"
	"github.com/meshcni/meshcni/pkg/spec"
)

// podSpec is a spec with every kind of field set away from the defaults.
func podSpec() *spec.Spec {
	s := spec.PodDefaults()
	s.Mode = spec.ModeTProxy
	s.InboundPorts = spec.PortSet{Ports: []uint16{8080, 9090}}
	s.OutboundIPRanges = spec.PrefixSet{Prefixes: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("fd00::/8")}}
	s.EnableIPv6 = true
	return &s
}

func open(t *testing.T, dir string, o sandboxstate.Options) *sandboxstate.Store {
	t.Helper()
	s, err := sandboxstate.Open(dir, o)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestRoundTrip: an entry written by one store is read back by the next (the
// agent's restart) exactly, its file 0600 in a 0700 directory; Delete removes it
// from both.
func TestRoundTrip(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "sandboxes")
	at := time.Date(2026, 12, 2, 0, 0, 0, 0, time.UTC)
	s := open(t, dir, sandboxstate.Options{Now: func() time.Time { return at }})
	netns := &sandboxstate.Netns{Path: "/var/run/netns/cni-1", Dev: 4, Inode: 4026532712, Cookie: 4097}
	want := sandboxstate.Entry{V: sandboxstate.Version, ID: "0123abcd", Namespace: "app", Name: "web", UID: "u1",
		Decision: sandboxstate.Meshed, Reason: "injected", Netns: netns, Spec: podSpec(), NetnsCookie: 4097, EBPFMode: "both", Updated: at}
	if err := s.Update("0123abcd", func(e *sandboxstate.Entry) {
		e.Namespace, e.Name, e.UID, e.Spec = "app", "web", "u1", podSpec()
		e.Decision, e.Reason, e.Netns = sandboxstate.Meshed, "injected", &sandboxstate.Netns{Path: "/var/run/netns/cni-1", Dev: 4, Inode: 4026532712, Cookie: 4097}
	}); err != nil {
		t.Fatal(err)
	}
	if err := s.Update("0123abcd", func(e *sandboxstate.Entry) { e.NetnsCookie, e.EBPFMode = 4097, "both" }); err != nil {
		t.Fatal(err)
	}
	for path, mode := range map[string]os.FileMode{dir: 0o700 | os.ModeDir, filepath.Join(dir, "0123abcd.json"): 0o600} {
		if fi, err := os.Stat(path); err != nil || fi.Mode() != mode {
			t.Errorf("%s: mode %v (%v), want %v", path, fi.Mode(), err, mode)
		}
	}
	again := open(t, dir, sandboxstate.Options{})
	got, ok := again.Get("0123abcd")
	if !ok || !sameJSON(t, got, want) {
		t.Fatalf("after reopening: %+v, %v; want %+v", got, ok, want)
	}
	if len(again.Skipped()) != 0 {
		t.Errorf("skipped %v", again.Skipped())
	}
	got.Spec.InboundPorts.Ports[0] = 1 // a copy: the store keeps its own
	got.Netns.Inode = 1
	if e, _ := again.Get("0123abcd"); e.Spec.InboundPorts.Ports[0] != 8080 || e.Netns.Inode != 4026532712 {
		t.Error("Get returned the store's own spec or netns")
	}
	if err := again.Update("0123abcd", func(e *sandboxstate.Entry) { e.Decision = "maybe" }); err == nil {
		t.Error("an unknown decision was written")
	}
	if err := again.Delete("0123abcd"); err != nil {
		t.Fatal(err)
	}
	if err := again.Delete("0123abcd"); err != nil {
		t.Errorf("deleting an absent entry: %v", err)
	}
	if n := open(t, dir, sandboxstate.Options{}).Len(); n != 0 {
		t.Errorf("%d entries after Delete", n)
	}
}

func sameJSON(t *testing.T, a, b any) bool {
	t.Helper()
	x, err1 := json.Marshal(a)
	y, err2 := json.Marshal(b)
	if err1 != nil || err2 != nil {
		t.Fatal(err1, err2)
	}
	return string(x) == string(y)
}

// TestOpenSkips: files the store cannot use are reported, each with its reason,
// left in place, and do not keep the good entries from loading; a temporary file
// a crash left mid-write is removed.
func TestOpenSkips(t *testing.T) {
	good := `{"v":1,"id":"good","namespace":"app","name":"web","netns_cookie":7,"updated":"2026-12-02T00:00:00Z"}`
	for _, tt := range []struct {
		name, file, content string
		why                 string // "": loaded, "-": removed silently
	}{
		{"good", "good.json", good, ""},
		{"corrupt", "bad1.json", `{"v":1,"id":"bad1",`, "corrupt"},
		{"not json", "bad2.json", "\x00\x01binary", "corrupt"},
		{"other version", "bad3.json", `{"v":2,"id":"bad3"}`, "format version 2"},
		{"no version", "bad4.json", `{"id":"bad4"}`, "format version 0"},
		{"id mismatch", "bad5.json", `{"v":1,"id":"other"}`, `holds sandbox "other"`},
		{"unknown name", "notes.txt", "hello", "not a sandbox state file"},
		{"bad id", "a b.json", good, "not a sandbox state file"},
		{"too large", "big.json", `{"v":1,"id":"big","name":"` + strings.Repeat("x", sandboxstate.MaxFileSize) + `"}`, "larger than"},
		{"crash leftover", ".good.json.tmp-123", "{", "-"},
		{"foreign decision", "bad6.json", `{"v":1,"id":"bad6","decision":"evicted"}`, `foreign: decision "evicted"`},
		{"netns without inode", "bad7.json", `{"v":1,"id":"bad7","netns":{"dev":4}}`, "foreign: netns without an inode"},
		{"reason too long", "bad8.json", `{"v":1,"id":"bad8","reason":"` + strings.Repeat("x", sandboxstate.MaxReasonLength+1) + `"}`, "foreign: reason of"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			for name, content := range map[string]string{tt.file: tt.content, "other.json": `{"v":1,"id":"other","uid":"u9","updated":"2026-12-02T00:00:00Z"}`} {
				if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			s := open(t, dir, sandboxstate.Options{})
			if e, ok := s.Get("other"); !ok || e.UID != "u9" {
				t.Errorf("the good neighbour did not load: %+v, %v", e, ok)
			}
			skipped := s.Skipped()
			_, statErr := os.Stat(filepath.Join(dir, tt.file))
			switch tt.why {
			case "":
				if e, ok := s.Get("good"); !ok || e.NetnsCookie != 7 || len(skipped) != 0 {
					t.Errorf("entry %+v, %v; skipped %v", e, ok, skipped)
				}
			case "-":
				if len(skipped) != 0 || !os.IsNotExist(statErr) {
					t.Errorf("skipped %v; leftover stat %v (want removed)", skipped, statErr)
				}
			default:
				if len(skipped) != 1 || !strings.Contains(skipped[0].Error(), tt.why) || !strings.Contains(skipped[0].Error(), tt.file) {
					t.Errorf("skipped %v, want one naming %s: %s", skipped, tt.file, tt.why)
				}
				if statErr != nil {
					t.Errorf("the skipped file is gone: %v", statErr)
				}
				if s.Len() != 1 {
					t.Errorf("%d entries, want the good neighbour only", s.Len())
				}
			}
		})
	}
}

// TestBadIDs: what cannot be a sandbox ID (a path, empty, too long) is refused
// before any file is touched.
func TestBadIDs(t *testing.T) {
	dir := t.TempDir()
	s := open(t, dir, sandboxstate.Options{})
	for _, id := range []string{"", "../escape", "a/b", ".hidden", "a b", strings.Repeat("a", sandboxstate.MaxIDLength+1)} {
		if err := s.Update(id, func(*sandboxstate.Entry) {}); err == nil {
			t.Errorf("Update(%q) accepted", id)
		}
		if err := s.Delete(id); err == nil {
			t.Errorf("Delete(%q) accepted", id)
		}
	}
	if des, _ := os.ReadDir(dir); len(des) != 0 {
		t.Errorf("files written: %v", des)
	}
	if _, err := os.Stat(filepath.Join(filepath.Dir(dir), "escape.json")); !os.IsNotExist(err) {
		t.Errorf("escaped the directory: %v", err)
	}
}

// TestBound: past Max a new sandbox is refused with ErrFull, the known ones are
// still updated; Open loads at most Max and reports the rest.
func TestBound(t *testing.T) {
	dir := t.TempDir()
	s := open(t, dir, sandboxstate.Options{Max: 2})
	for _, id := range []string{"a", "b"} {
		if err := s.Update(id, func(*sandboxstate.Entry) {}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Update("c", func(*sandboxstate.Entry) {}); !errors.Is(err, sandboxstate.ErrFull) {
		t.Fatalf("third sandbox: %v, want ErrFull", err)
	}
	if err := s.Update("a", func(e *sandboxstate.Entry) { e.NetnsCookie = 1 }); err != nil {
		t.Fatalf("update of a known sandbox when full: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "c.json")); !os.IsNotExist(err) {
		t.Errorf("refused sandbox written: %v", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "c.json"), []byte(`{"v":1,"id":"c"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	small := open(t, dir, sandboxstate.Options{Max: 2})
	if small.Len() != 2 || len(small.Skipped()) != 1 || !errors.Is(small.Skipped()[0], sandboxstate.ErrFull) {
		t.Errorf("reopened with Max 2 over 3 files: %d entries, skipped %v", small.Len(), small.Skipped())
	}
}

// TestGC: Select finds entries; GC removes (files included) the entries keep
// rejects and returns them.
func TestGC(t *testing.T) {
	dir := t.TempDir()
	s := open(t, dir, sandboxstate.Options{})
	for i, uid := range []string{"live", "gone", "live", "gone"} {
		if err := s.Update(fmt.Sprintf("s%d", i), func(e *sandboxstate.Entry) { e.UID, e.NetnsCookie = uid, uint64(i+1) }); err != nil {
			t.Fatal(err)
		}
	}
	var live []string
	for _, e := range s.Select(func(e *sandboxstate.Entry) bool { return e.UID == "live" }) {
		live = append(live, e.ID)
	}
	if strings.Join(live, ",") != "s0,s2" {
		t.Errorf("Select by UID: %v, want s0,s2", live)
	}
	gone, err := s.GC(func(e sandboxstate.Entry) bool { return e.UID == "live" })
	if err != nil {
		t.Fatal(err)
	}
	if len(gone) != 2 || gone[0].ID != "s1" || gone[1].ID != "s3" || gone[1].NetnsCookie != 4 {
		t.Errorf("collected %+v, want s1 and s3 with their cookies", gone)
	}
	var left []string
	for _, e := range open(t, dir, sandboxstate.Options{}).List() {
		left = append(left, e.ID)
	}
	if strings.Join(left, ",") != "s0,s2" {
		t.Errorf("left on disk %v, want s0,s2", left)
	}
}

// TestConcurrentUpdates: many goroutines updating the same and different
// sandboxes at once lose no change (each field written by its own writer), and
// what is on disk equals what is in memory.
func TestConcurrentUpdates(t *testing.T) {
	dir := t.TempDir()
	s := open(t, dir, sandboxstate.Options{})
	const sandboxes, writers = 8, 16
	var wg sync.WaitGroup
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range sandboxes {
				id := fmt.Sprintf("sb%d", i)
				if err := s.Update(id, func(e *sandboxstate.Entry) {
					e.NetnsCookie |= 1 << w // read-modify-write: lost without the lock
				}); err != nil {
					t.Error(err)
				}
			}
		}()
	}
	wg.Wait()
	disk := open(t, dir, sandboxstate.Options{})
	for i := range sandboxes {
		id := fmt.Sprintf("sb%d", i)
		mem, _ := s.Get(id)
		got, _ := disk.Get(id)
		if mem.NetnsCookie != 1<<writers-1 || got.NetnsCookie != mem.NetnsCookie {
			t.Errorf("%s: cookie bits in memory %b, on disk %b; want %b", id, mem.NetnsCookie, got.NetnsCookie, 1<<writers-1)
		}
	}
	if des, _ := os.ReadDir(dir); len(des) != sandboxes {
		t.Errorf("%d files, want %d (no temporary file left)", len(des), sandboxes)
	}
}
