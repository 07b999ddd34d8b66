package iptables

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/netnsutil"
	"github.com/meshcni/meshcni/pkg/rules"
	"github.com/meshcni/meshcni/pkg/spec"
)

// TestMain lets this test binary stand in for an iptables tool: run through a link
// named after the tool (fakeTools), it acts as that tool as its directory's files say.
func TestMain(m *testing.M) {
	if name := filepath.Base(os.Args[0]); strings.HasPrefix(name, "iptables-") || strings.HasPrefix(name, "ip6tables-") {
		os.Exit(fakeTool(filepath.Dir(os.Args[0]), name))
	}
	os.Exit(m.Run())
}

// fakeTool appends "<name> <args>" to dir/calls, then: with dir/<name>.huge it writes
// its PID to dir/<name>.pid and prints save lines for ever; a -save prints an empty
// nat table; a -restore reads its input.
func fakeTool(dir, name string) int {
	f, err := os.OpenFile(filepath.Join(dir, "calls"), os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		return 3
	}
	fmt.Fprintln(f, strings.Join(append([]string{name}, os.Args[1:]...), " "))
	f.Close()
	if _, err := os.Stat(filepath.Join(dir, name+".huge")); err == nil {
		_ = os.WriteFile(filepath.Join(dir, name+".pid"), []byte(fmt.Sprint(os.Getpid())), 0o644)
		line := []byte("-A OUTPUT -d 192.0.2.1/32 -p tcp -m tcp --dport 9 -j ACCEPT\n")
		for {
			if _, err := os.Stdout.Write(line); err != nil {
				return 4
			}
		}
	}
	if strings.HasSuffix(name, "-save") {
		fmt.Print("*nat\n:PREROUTING ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n")
		return 0
	}
	_, _ = io.Copy(io.Discard, os.Stdin)
	return 0
}

// fakeTools makes a directory of links to this test binary, one per tool name.
func fakeTools(t *testing.T, names ...string) string {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	for _, n := range names {
		if err := os.Symlink(self, filepath.Join(dir, n)); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func calls(t *testing.T, dir string) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "calls"))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	return strings.Split(strings.TrimSpace(string(b)), "\n")
}

func withDirs(t *testing.T, kind backend.Kind, dirs ...string) *Backend {
	t.Helper()
	b, err := New(kind)
	if err != nil {
		t.Fatal(err)
	}
	b.dirs = dirs
	return b
}

var nftTools = []string{"iptables-nft-save", "ip6tables-nft-save", "iptables-nft-restore", "ip6tables-nft-restore"}

// TestToolsNotFromPATH: a PATH that leads to a fake iptables-nft-save is never used;
// the tools come from ToolDirs only, and a tool missing there is an error naming the
// directories searched.
func TestToolsNotFromPATH(t *testing.T) {
	fake := fakeTools(t, nftTools...)
	t.Setenv("PATH", fake)
	empty := t.TempDir()
	b := withDirs(t, backend.IptablesNft, empty)
	_, err := b.Save(context.Background(), "", rules.V4)
	if err == nil || !strings.Contains(err.Error(), "iptables-nft-save: no executable file of that name in "+empty+" (PATH is not searched)") {
		t.Errorf("save with the tool in PATH only: %v, want the error naming %s", err, empty)
	}
	if c := calls(t, fake); c != nil {
		t.Errorf("the fake tool in PATH ran: %q", c)
	}

	// The default directories: a tool found there is there, never the PATH's.
	for _, name := range nftTools {
		p, err := lookTool(name, ToolDirs)
		if err != nil {
			if !strings.Contains(err.Error(), strings.Join(ToolDirs, ", ")) {
				t.Errorf("%s: %v, want the directories named", name, err)
			}
			continue
		}
		if filepath.Dir(p) == fake || !strings.HasPrefix(p, "/") {
			t.Errorf("%s resolved to %s", name, p)
		}
		found := false
		for _, d := range ToolDirs {
			found = found || filepath.Dir(p) == d
		}
		if !found {
			t.Errorf("%s resolved to %s, outside %v", name, p, ToolDirs)
		}
	}
}

// TestLookToolOrder: the first directory holding an executable regular file wins; a
// directory, a non-executable file or a dangling link of that name is passed over.
func TestLookToolOrder(t *testing.T) {
	a, b, c := t.TempDir(), t.TempDir(), t.TempDir()
	const name = "iptables-nft-save"
	if err := os.Mkdir(filepath.Join(a, name), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(b, name), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(c, name), []byte("x"), 0o755); err != nil {
		t.Fatal(err)
	}
	d := t.TempDir()
	if err := os.Symlink(filepath.Join(d, "gone"), filepath.Join(d, name)); err != nil {
		t.Fatal(err)
	}
	if p, err := lookTool(name, []string{d, a, b, c}); err != nil || p != filepath.Join(c, name) {
		t.Fatalf("lookTool = %q, %v; want %s", p, err, filepath.Join(c, name))
	}
	if _, err := lookTool(name, []string{d, a, b}); err == nil {
		t.Fatal("found a tool where none is executable")
	}
}

// TestSaveOutputBounded: a save tool that prints without end is killed once it passes
// MaxOutput; the operation fails naming the bound and nothing is restored (no
// -restore runs, or only the rollback of the family already changed).
func TestSaveOutputBounded(t *testing.T) {
	s := spec.PodDefaults()
	s.EnableIPv6 = true
	rs := rules.Build(&s)
	for _, tc := range []struct {
		huge        string
		wantRestore []string // the restores that run, in order
	}{
		{huge: "iptables-nft-save"},
		// IPv4 went in before the IPv6 save failed: it is rolled back (a restore
		// without --noflush replaces the tables with the snapshot).
		{huge: "ip6tables-nft-save", wantRestore: []string{"iptables-nft-restore --noflush", "iptables-nft-restore"}},
	} {
		t.Run(tc.huge, func(t *testing.T) {
			dir := fakeTools(t, nftTools...)
			if err := os.WriteFile(filepath.Join(dir, tc.huge+".huge"), nil, 0o644); err != nil {
				t.Fatal(err)
			}
			b := withDirs(t, backend.IptablesNft, dir)
			err := b.Apply(context.Background(), "", rs)
			if !errors.Is(err, netnsutil.ErrOutputLimit) || !strings.Contains(err.Error(), fmt.Sprintf("more than %d bytes", MaxOutput)) ||
				!strings.Contains(err.Error(), tc.huge) {
				t.Fatalf("apply with %s printing without end: %v, want ErrOutputLimit naming the tool and %d bytes", tc.huge, err, MaxOutput)
			}
			var restores []string
			for _, c := range calls(t, dir) {
				if strings.Contains(c, "-restore") {
					restores = append(restores, c)
				}
			}
			if strings.Join(restores, "\n") != strings.Join(tc.wantRestore, "\n") {
				t.Errorf("restores run: %q, want %q", restores, tc.wantRestore)
			}
			pid, err := os.ReadFile(filepath.Join(dir, tc.huge+".pid"))
			if err != nil {
				t.Fatal(err)
			}
			var n int
			fmt.Sscan(string(pid), &n)
			if err := unix.Kill(n, 0); !errors.Is(err, unix.ESRCH) {
				t.Errorf("%s (pid %d) still exists: kill 0 = %v", tc.huge, n, err)
			}
			// Clean, Check and Live fail the same way (Clean must not pass over it as
			// a family the tool cannot read).
			if err := b.Clean(context.Background(), ""); !errors.Is(err, netnsutil.ErrOutputLimit) {
				t.Errorf("clean: %v, want ErrOutputLimit", err)
			}
			if _, err := b.Live(context.Background(), ""); !errors.Is(err, netnsutil.ErrOutputLimit) {
				t.Errorf("live: %v, want ErrOutputLimit", err)
			}
		})
	}
}
