// Package sandboxstate is the node agent's memory of each pod sandbox across its
// own restarts: what it learned at the sandbox's CNI ADD (the pod, what the ADD
// decided and why, the network namespace's identity, the redirect spec the pod was
// given, the eBPF mode it enabled), one small JSON file per sandbox in a directory
// of the agent's run directory.
//
// The store is keyed by the sandbox (CNI_CONTAINERID). Each change is written to
// a temporary file and renamed over the sandbox's file (mode 0600), so a crash
// leaves the old entry or the new one. Open reads every entry; a file it cannot
// use (unreadable, corrupt, of another format version, too large, not named like
// an entry) is reported in Skipped and left alone, and the other entries load.
// The store holds at most Max entries: a new sandbox past that is refused with
// ErrFull (a node runs a few hundred pods at most; entries are removed at the
// sandbox's DEL and collected by GC for sandboxes that no longer exist).
package sandboxstate

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/meshcni/meshcni/pkg/fileutil"
	"github.com/meshcni/meshcni/pkg/spec"
)

// Version is the format version of an entry file.
const Version = 1

// Limits of the store.
const (
	// DefaultMax bounds the entries (sandboxes) of a store.
	DefaultMax = 4096
	// MaxFileSize bounds an entry file; a larger one is skipped.
	MaxFileSize = 256 << 10
	// MaxIDLength bounds a sandbox ID.
	MaxIDLength = 256
	// MaxReasonLength bounds an entry's Reason; a longer one is cut.
	MaxReasonLength = 1024
)

// Decision is what a sandbox's ADD decided about its pod.
type Decision string

// The decisions ("" : unknown, an entry written without one).
const (
	Meshed  Decision = "meshed"  // the redirect was applied
	Skipped Decision = "skipped" // the pod was left alone (Entry.Reason says why)
)

// Netns identifies a sandbox's network namespace as the plugin read it from
// CNI_NETNS at ADD. Inode and Dev are the namespace file's (an inode number can be
// reused once the namespace is freed); Cookie is its SO_NETNS_COOKIE, never reused
// while the host runs (0: unknown, a kernel older than 5.14).
type Netns struct {
	Path   string `json:"path,omitempty"`
	Dev    uint64 `json:"dev"`
	Inode  uint64 `json:"inode"`
	Cookie uint64 `json:"cookie,omitempty"`
}

const suffix = ".json"

// ErrFull is returned when a new sandbox would exceed the store's Max entries.
var ErrFull = errors.New("sandbox state store full")

// Entry is what the agent knows of one pod sandbox.
type Entry struct {
	// V is the format version (Version).
	V int `json:"v"`
	// ID is the sandbox's (CNI_CONTAINERID).
	ID string `json:"id"`
	// Namespace, Name and UID are the pod's.
	Namespace string `json:"namespace,omitempty"`
	Name      string `json:"name,omitempty"`
	UID       string `json:"uid,omitempty"`
	// Decision is what the sandbox's ADD decided, Reason why (the plugin's words).
	Decision Decision `json:"decision,omitempty"`
	Reason   string   `json:"reason,omitempty"`
	// Netns is the sandbox's network namespace (nil: unknown).
	Netns *Netns `json:"netns,omitempty"`
	// Spec is the redirect spec the pod's sandbox was given (nil: unknown).
	Spec *spec.Spec `json:"spec,omitempty"`
	// NetnsCookie is the sandbox netns's cookie the agent put on the eBPF
	// allow-list (0: none), EBPFMode the acceleration it enabled.
	NetnsCookie uint64 `json:"netns_cookie,omitempty"`
	EBPFMode    string `json:"ebpf_mode,omitempty"`
	// Updated is when the entry was last written.
	Updated time.Time `json:"updated"`
}

// Store is the per-sandbox state in one directory. Its methods are safe for
// concurrent use.
type Store struct {
	dir string
	max int
	now func() time.Time

	mu      sync.Mutex
	entries map[string]Entry
	skipped []error
}

// Options configure Open.
type Options struct {
	// Max bounds the entries (default DefaultMax).
	Max int
	// Now is the clock (default time.Now).
	Now func() time.Time
}

// Open creates dir (0700) when missing and loads its entries. It fails only when
// the directory cannot be made or listed; unusable files are in Skipped.
func Open(dir string, o Options) (*Store, error) {
	if o.Max <= 0 {
		o.Max = DefaultMax
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("sandbox state directory: %w", err)
	}
	des, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("sandbox state directory: %w", err)
	}
	s := &Store{dir: dir, max: o.Max, now: o.Now, entries: map[string]Entry{}}
	for _, de := range des {
		s.load(de)
	}
	return s, nil
}

// load reads one directory entry into the store, or records why it is skipped.
// Temporary files a crash left mid-write are removed.
func (s *Store) load(de os.DirEntry) {
	name := de.Name()
	path := filepath.Join(s.dir, name)
	if strings.HasPrefix(name, ".") && strings.Contains(name, suffix+".tmp-") {
		_ = os.Remove(path)
		return
	}
	id, ok := strings.CutSuffix(name, suffix)
	if !ok || CheckID(id) != nil || !de.Type().IsRegular() {
		s.skipped = append(s.skipped, fmt.Errorf("%s: not a sandbox state file (want <sandbox ID>%s, a regular file)", path, suffix))
		return
	}
	if len(s.entries) >= s.max {
		s.skipped = append(s.skipped, fmt.Errorf("%s: %w (%d entries)", path, ErrFull, s.max))
		return
	}
	e, err := readEntry(path)
	if err == nil && e.ID != id {
		err = fmt.Errorf("holds sandbox %q, not %q", e.ID, id)
	}
	if err != nil {
		s.skipped = append(s.skipped, fmt.Errorf("%s: %w", path, err))
		return
	}
	s.entries[id] = e
}

func readEntry(path string) (Entry, error) {
	f, err := os.Open(path)
	if err != nil {
		return Entry{}, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, MaxFileSize+1))
	if err != nil {
		return Entry{}, err
	}
	if len(b) > MaxFileSize {
		return Entry{}, fmt.Errorf("larger than %d bytes", MaxFileSize)
	}
	var e Entry
	if err := json.Unmarshal(b, &e); err != nil {
		return Entry{}, fmt.Errorf("corrupt: %w", err)
	}
	if e.V != Version {
		return Entry{}, fmt.Errorf("format version %d, want %d", e.V, Version)
	}
	if err := e.check(); err != nil {
		return Entry{}, fmt.Errorf("foreign: %w", err)
	}
	return e, nil
}

// check rejects an entry no agent writes: an unknown decision, a netns without
// an inode, an over-long reason.
func (e *Entry) check() error {
	switch e.Decision {
	case "", Meshed, Skipped:
	default:
		return fmt.Errorf("decision %q: want %s or %s", e.Decision, Meshed, Skipped)
	}
	if e.Netns != nil && e.Netns.Inode == 0 {
		return errors.New("netns without an inode")
	}
	if len(e.Reason) > MaxReasonLength {
		return fmt.Errorf("reason of %d bytes: want at most %d", len(e.Reason), MaxReasonLength)
	}
	return nil
}

// Skipped lists the files Open could not use, each with its reason.
func (s *Store) Skipped() []error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]error(nil), s.skipped...)
}

// Dir is the store's directory.
func (s *Store) Dir() string { return s.dir }

// CheckID rejects what cannot be a sandbox ID: empty, longer than MaxIDLength,
// or other than the CNI specification's characters (letters, digits, '_', '.',
// '-'; not starting with '.').
func CheckID(id string) error {
	if id == "" || len(id) > MaxIDLength {
		return fmt.Errorf("sandbox ID %q: want 1 to %d characters", id, MaxIDLength)
	}
	if id[0] == '.' {
		return fmt.Errorf("sandbox ID %q: starts with '.'", id)
	}
	for _, c := range id {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '.' || c == '-') {
			return fmt.Errorf("sandbox ID %q: character %q: want letters, digits, '_', '.', '-'", id, c)
		}
	}
	return nil
}

// Update changes the sandbox's entry with f (a new entry has only its ID set) and
// writes it. The entry in memory changes only when the file was written.
func (s *Store) Update(id string, f func(*Entry)) error {
	if err := CheckID(id); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.entries[id]
	if !ok && len(s.entries) >= s.max {
		return fmt.Errorf("sandbox %s: %w (%d entries)", id, ErrFull, s.max)
	}
	e = e.clone()
	f(&e)
	e.V, e.ID, e.Updated = Version, id, s.now().UTC()
	if len(e.Reason) > MaxReasonLength {
		e.Reason = strings.ToValidUTF8(e.Reason[:MaxReasonLength], "")
	}
	if err := e.check(); err != nil {
		return fmt.Errorf("sandbox %s: %w", id, err)
	}
	b, err := json.Marshal(e)
	if err != nil {
		return fmt.Errorf("sandbox %s: encode: %w", id, err)
	}
	if err := fileutil.WriteFileAtomic(s.path(id), append(b, '\n'), 0o600); err != nil {
		return fmt.Errorf("sandbox %s: %w", id, err)
	}
	s.entries[id] = e
	return nil
}

// Get returns a copy of the sandbox's entry.
func (s *Store) Get(id string) (Entry, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.entries[id]
	return e.clone(), ok
}

// List returns copies of every entry, by ID.
func (s *Store) List() []Entry {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]Entry, 0, len(s.entries))
	for _, e := range s.entries {
		out = append(out, e.clone())
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// Select returns copies of the entries match accepts, by ID; match sees each
// entry without copying it and must not keep or change it.
func (s *Store) Select(match func(*Entry) bool) []Entry {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []Entry
	for _, e := range s.entries {
		if match(&e) {
			out = append(out, e.clone())
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// Len is the number of entries.
func (s *Store) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.entries)
}

// Delete removes the sandbox's entry; an absent one is not an error.
func (s *Store) Delete(id string) error {
	if err := CheckID(id); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.delete(id)
}

func (s *Store) delete(id string) error {
	if err := os.Remove(s.path(id)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("sandbox %s: %w", id, err)
	}
	delete(s.entries, id)
	return nil
}

// GC removes the entries keep rejects (sandboxes that no longer exist) and
// returns them. An entry whose file cannot be removed stays, and the error says
// which.
func (s *Store) GC(keep func(Entry) bool) ([]Entry, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var gone []Entry
	var errs []error
	for id, e := range s.entries {
		if keep(e.clone()) {
			continue
		}
		if err := s.delete(id); err != nil {
			errs = append(errs, err)
			continue
		}
		gone = append(gone, e)
	}
	sort.Slice(gone, func(i, j int) bool { return gone[i].ID < gone[j].ID })
	return gone, errors.Join(errs...)
}

func (s *Store) path(id string) string { return filepath.Join(s.dir, id+suffix) }

// clone copies the entry, its netns and spec deeply (callers may change what they get).
func (e Entry) clone() Entry {
	if e.Netns != nil {
		n := *e.Netns
		e.Netns = &n
	}
	if e.Spec != nil {
		var c spec.Spec
		b, err := json.Marshal(e.Spec)
		if err == nil && json.Unmarshal(b, &c) == nil {
			e.Spec = &c
		}
	}
	return e
}
