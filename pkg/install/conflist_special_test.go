package install

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestSpecialFilesSkipped: a FIFO, a device-like or an oversized file among the
// configuration files is passed over with a reason, never opened for a blocking read
// (a FIFO named 05-fifo.conflist used to hang the agent's readiness check) nor read
// without bound; the valid configuration after them is still found, and a named
// primary that is not a regular file is refused.
func TestSpecialFilesSkipped(t *testing.T) {
	dir := t.TempDir()
	if err := syscall.Mkfifo(filepath.Join(dir, "05-fifo.conflist"), 0o644); err != nil {
		t.Fatal(err)
	}
	big := `{"cniVersion":"1.0.0","name":"big","plugins":[{"type":"ptp","pad":"` + strings.Repeat("x", maxConfigSize) + `"}]}`
	if err := os.WriteFile(filepath.Join(dir, "06-big.conflist"), []byte(big), 0o644); err != nil {
		t.Fatal(err)
	}
	// A symlink to a FIFO: followed as kubelet follows links, and still not opened blocking.
	if err := syscall.Mkfifo(filepath.Join(t.TempDir(), "fifo"), 0o644); err != nil {
		t.Fatal(err)
	}
	other := t.TempDir()
	if err := syscall.Mkfifo(filepath.Join(other, "fifo"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(other, "fifo"), filepath.Join(dir, "07-link.conflist")); err != nil {
		t.Fatal(err)
	}
	good := `{"cniVersion":"1.0.0","name":"good","plugins":[{"type":"ptp"}]}`
	if err := os.WriteFile(filepath.Join(dir, "10-good.conflist"), []byte(good), 0o644); err != nil {
		t.Fatal(err)
	}

	type found struct {
		p       *Primary
		skipped []Skipped
		err     error
	}
	done := make(chan found, 1)
	go func() {
		p, skipped, err := FindPrimary(dir, "")
		done <- found{p, skipped, err}
	}()
	var f found
	select {
	case f = <-done:
	case <-time.After(20 * time.Second): // a hang guard, not a speed bound
		t.Fatal("FindPrimary blocked on a special file")
	}
	if f.err != nil {
		t.Fatal(f.err)
	}
	if filepath.Base(f.p.Path) != "10-good.conflist" {
		t.Errorf("primary %s, want 10-good.conflist", f.p.Path)
	}
	reasons := map[string]string{}
	for _, s := range f.skipped {
		reasons[filepath.Base(s.Path)] = s.Err.Error()
	}
	for name, want := range map[string]string{
		"05-fifo.conflist": "not a regular file",
		"06-big.conflist":  "larger than",
		"07-link.conflist": "not a regular file",
	} {
		if !strings.Contains(reasons[name], want) {
			t.Errorf("%s skipped with %q, want a reason containing %q (skipped: %v)", name, reasons[name], want, reasons)
		}
	}

	// Named explicitly, a FIFO is an error, not a hang.
	go func() {
		_, _, err := FindPrimary(dir, "05-fifo.conflist")
		done <- found{err: err}
	}()
	select {
	case f = <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("FindPrimary of a named FIFO blocked")
	}
	if f.err == nil || !strings.Contains(f.err.Error(), "not a regular file") {
		t.Errorf("named FIFO: %v, want an error saying it is not a regular file", f.err)
	}
}
