package fileutil

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
)

func TestWriteFileAtomic(t *testing.T) {
	old := syscall.Umask(0o077)
	defer syscall.Umask(old)
	tests := []struct {
		name    string
		initial []byte
		data    []byte
		mode    os.FileMode
	}{
		{"new file", nil, []byte("hello"), 0o644},
		{"replace", []byte("old content"), []byte("new"), 0o600},
		{"empty", []byte("x"), nil, 0o640},
		{"executable", nil, []byte("#!bin"), 0o755},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			p := filepath.Join(dir, "f")
			if tt.initial != nil {
				if err := os.WriteFile(p, tt.initial, 0o666); err != nil {
					t.Fatal(err)
				}
			}
			if err := WriteFileAtomic(p, tt.data, tt.mode); err != nil {
				t.Fatalf("WriteFileAtomic: %v", err)
			}
			got, err := os.ReadFile(p)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, tt.data) {
				t.Errorf("content = %q, want %q", got, tt.data)
			}
			st, _ := os.Stat(p)
			if st.Mode().Perm() != tt.mode {
				t.Errorf("mode = %v, want %v", st.Mode().Perm(), tt.mode)
			}
			assertNoTemp(t, dir)
		})
	}
}

func assertNoTemp(t *testing.T, dir string) {
	t.Helper()
	ents, _ := os.ReadDir(dir)
	if len(ents) != 1 {
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Errorf("directory holds %v, want only the target", names)
	}
}

func TestWriteAtomicPreconditionAborts(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "f")
	if err := os.WriteFile(p, []byte("keep"), 0o644); err != nil {
		t.Fatal(err)
	}
	errChanged := errors.New("changed")
	err := WriteAtomic(p, bytes.NewReader([]byte("new")), 0o644, func() error { return errChanged })
	if !errors.Is(err, errChanged) {
		t.Fatalf("err = %v, want %v", err, errChanged)
	}
	got, _ := os.ReadFile(p)
	if string(got) != "keep" {
		t.Errorf("content = %q, want untouched", got)
	}
	assertNoTemp(t, dir)
}

func TestWriteFileAtomicMissingDir(t *testing.T) {
	err := WriteFileAtomic(filepath.Join(t.TempDir(), "nope", "f"), []byte("x"), 0o644)
	if err == nil {
		t.Fatal("want an error for a missing directory")
	}
}

// A concurrent reader never sees a partial file.
func TestWriteFileAtomicConcurrentReader(t *testing.T) {
	p := filepath.Join(t.TempDir(), "f")
	a := bytes.Repeat([]byte("a"), 64<<10)
	b := bytes.Repeat([]byte("b"), 64<<10)
	if err := WriteFileAtomic(p, a, 0o644); err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			got, err := os.ReadFile(p)
			if err != nil {
				t.Errorf("read: %v", err)
				return
			}
			if !bytes.Equal(got, a) && !bytes.Equal(got, b) {
				t.Errorf("read a torn file of %d bytes", len(got))
				return
			}
		}
	}()
	for i := range 200 {
		data := a
		if i%2 == 0 {
			data = b
		}
		if err := WriteFileAtomic(p, data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	close(stop)
	wg.Wait()
}
