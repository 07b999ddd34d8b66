package loadtest

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestMeshcniEntries(t *testing.T) {
	tests := []struct {
		name, doc string
		want      int
		wantErr   string
	}{
		{"none", `{"plugins":[{"type":"bridge"},{"type":"portmap"}]}`, 0, ""},
		{"one", `{"plugins":[{"type":"bridge"},{"type":"meshcni"}]}`, 1, ""},
		{"two", `{"plugins":[{"type":"meshcni"},{"type":"bridge"},{"type":"meshcni"}]}`, 2, ""},
		{"half written", `{"plugins":[{"type":"bridge"},{"ty`, 0, "not valid JSON"},
		{"empty file", ``, 0, "not valid JSON"},
		{"a single conf", `{"type":"bridge"}`, 0, "no plugins array"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := MeshcniEntries([]byte(tt.doc))
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err %v, want %q", err, tt.wantErr)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Fatalf("got %d, %v; want %d", got, err, tt.want)
			}
		})
	}
}

func TestCount(t *testing.T) {
	const name = "MESHCNI_LOADTEST_UNIT_COUNT"
	tests := []struct {
		val     string
		set     bool
		want    int
		wantErr bool
	}{
		{"", false, 7, false},
		{"", true, 7, false},
		{"10000", true, 10000, false},
		{"0", true, 0, true},
		{"-3", true, 0, true},
		{"ten", true, 0, true},
	}
	for _, tt := range tests {
		if tt.set {
			t.Setenv(name, tt.val)
		} else {
			os.Unsetenv(name)
		}
		got, err := Count(name, 7)
		if (err != nil) != tt.wantErr || got != tt.want {
			t.Errorf("%s=%q (set %v): %d, %v; want %d, error %v", name, tt.val, tt.set, got, err, tt.want, tt.wantErr)
		}
		if err != nil && !strings.Contains(err.Error(), name) {
			t.Errorf("error %q does not name %s", err, name)
		}
	}
	t.Setenv(name, "250ms")
	if d, err := Duration(name, time.Second); err != nil || d != 250*time.Millisecond {
		t.Errorf("Duration: %v %v", d, err)
	}
	t.Setenv(name, "soon")
	if _, err := Duration(name, time.Second); err == nil {
		t.Error("Duration accepted \"soon\"")
	}
}

func TestReadProc(t *testing.T) {
	root := t.TempDir()
	dir := filepath.Join(root, "42")
	if err := os.MkdirAll(filepath.Join(dir, "fd"), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, fd := range []string{"0", "1", "2", "7"} {
		if err := os.WriteFile(filepath.Join(dir, "fd", fd), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	status := "Name:\tmeshcni-agent\nVmRSS:\t   51200 kB\nThreads:\t9\n"
	if err := os.WriteFile(filepath.Join(dir, "status"), []byte(status), 0o644); err != nil {
		t.Fatal(err)
	}
	s, err := ReadProc(root, 42)
	if err != nil {
		t.Fatal(err)
	}
	if s.FDs != 4 || s.Threads != 9 || s.RSS != 50<<20 || s.Goroutines != -1 {
		t.Fatalf("%+v", s)
	}
	if _, err := ReadProc(root, 43); err == nil {
		t.Fatal("no error for a missing process")
	}
	s.At, s.Goroutines = "cycle 10", 31
	want := "| cycle 10 | 4 | 31 | 9 | 50.0 |"
	if got := Table([]Sample{s}); !strings.Contains(got, want) {
		t.Fatalf("table:\n%s\nwant a row %s", got, want)
	}
}

func TestPercentiles(t *testing.T) {
	var ds []time.Duration
	for i := 100; i >= 1; i-- {
		ds = append(ds, time.Duration(i)*time.Millisecond)
	}
	p50, p99, mx := Percentiles(ds)
	if p50 != 51*time.Millisecond || p99 != 100*time.Millisecond || mx != 100*time.Millisecond {
		t.Fatalf("p50 %v p99 %v max %v", p50, p99, mx)
	}
	if ds[0] != 100*time.Millisecond {
		t.Fatal("Percentiles sorted its argument")
	}
	if a, b, c := Percentiles(nil); a+b+c != 0 {
		t.Fatal("non-zero for no samples")
	}
}

func TestMaxFailedADDs(t *testing.T) {
	t0 := time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC)
	at := func(from, to float64) Span {
		return Span{t0.Add(time.Duration(from * float64(time.Second))), t0.Add(time.Duration(to * float64(time.Second)))}
	}
	const timeout, pause = 20 * time.Second, 2 * time.Second // a failing ADD: ≥ 18 s of outage
	tests := []struct {
		name    string
		outages []Span
		workers int
		want    int
	}{
		{"no outage", nil, 4, 0},
		{"one outage shorter than a failing ADD", []Span{at(8, 20)}, 4, 0},
		{"one outage of exactly one failing ADD", []Span{at(0, 18)}, 4, 4},
		{"one outage of two failing ADDs and a half", []Span{at(0, 45)}, 4, 8},
		{"two short outages far apart", []Span{at(0, 12), at(20, 32)}, 4, 0},
		{"two short outages back to back count as one", []Span{at(0, 12), at(13.5, 25.5)}, 4, 4},
		{"back to back, given out of order", []Span{at(13.5, 25.5), at(0, 12)}, 4, 4},
		{"an outage inside another", []Span{at(0, 19), at(5, 6)}, 1, 1},
		{"a gap of exactly the pause separates", []Span{at(0, 12), at(14, 26)}, 4, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := MaxFailedADDs(tt.outages, timeout, pause, tt.workers)
			if err != nil || got != tt.want {
				t.Fatalf("MaxFailedADDs = %d, %v; want %d", got, err, tt.want)
			}
		})
	}
	if _, err := MaxFailedADDs([]Span{at(0, 1)}, pause, pause, 4); err == nil {
		t.Fatal("no error for an api_timeout no longer than the pause")
	}
}
