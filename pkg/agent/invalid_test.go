package agent

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	promtestutil "github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/meshcni/meshcni/pkg/install"
	"github.com/meshcni/meshcni/pkg/podget"
)

const bridgeConf = `{"cniVersion":"1.0.0","name":"bridge","plugins":[{"type":"bridge","bridge":"cni0"}]}`

// TestInvalidPrimaryLeftAlone: the primary list is rewritten in place by another
// writer (istio-cni's uninstaller removing its entry) and stays half-written for a
// while, under real fsnotify events and frequent resyncs. The agent never writes it,
// keeps the binary and kubeconfig, reports the episode once (a warning log line, one
// ConfigInvalid Event, the gauge and the episode counter), puts its entry into the
// next valid list when there is one (what CRI-O then uses), and when the primary is
// whole again — without meshcni's entry — puts the entry back into it, takes it out
// of the other list and clears the gauge.
func TestInvalidPrimaryLeftAlone(t *testing.T) {
	for _, tc := range []struct {
		name  string
		other bool // a later valid list: the runtime's fallback
	}{
		{"primary alone", false},
		{"primary and a later list", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			primary := filepath.Join(e.confDir, "10-calico.conflist")
			other := filepath.Join(e.confDir, "20-bridge.conflist")
			if err := os.WriteFile(primary, []byte(calico), 0o644); err != nil {
				t.Fatal(err)
			}
			if tc.other {
				if err := os.WriteFile(other, []byte(bridgeConf), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			r := startAgent(t, e.args("--resync", "20ms"), nil)
			eventually(t, 5*time.Second, "ready", r.a.Guard.Ready)
			whole, err := os.ReadFile(primary)
			if err != nil {
				t.Fatal(err)
			}
			if !hasEntry(primary) {
				t.Fatalf("no entry in the primary:\n%s", whole)
			}

			// The other writer truncates the file in place and stops half-way.
			half := whole[:len(whole)/2]
			if err := os.WriteFile(primary, half, 0o644); err != nil {
				t.Fatal(err)
			}
			gauge := r.a.Metrics.ConfigInvalid.WithLabelValues("10-calico.conflist")
			eventually(t, 5*time.Second, "invalid gauge set", func() error {
				if v := promtestutil.ToFloat64(gauge); v != 1 {
					return fmt.Errorf("gauge %v", v)
				}
				return nil
			})
			if tc.other {
				eventually(t, 5*time.Second, "entry in the later list", func() error {
					if !hasEntry(other) {
						return errors.New("no entry")
					}
					return nil
				})
			}
			// Many resyncs (every 20 ms) while the file stays half-written.
			time.Sleep(400 * time.Millisecond)
			if got, _ := os.ReadFile(primary); !bytes.Equal(got, half) {
				t.Fatalf("the half-written primary was written by the agent:\n%s", got)
			}
			for _, p := range []string{filepath.Join(e.binDir, "meshcni"), filepath.Join(e.binDir, podget.HelperName), filepath.Join(e.runDir, KubeconfigName)} {
				if _, err := os.Stat(p); err != nil {
					t.Errorf("%s gone while the primary is invalid: %v", p, err)
				}
			}
			ev := r.rec.all()
			if len(ev) != 1 || !strings.HasPrefix(ev[0], "ConfigInvalid: ") || !strings.Contains(ev[0], primary) {
				t.Errorf("events = %q, want one ConfigInvalid naming %s", ev, primary)
			}
			if tc.other && !strings.Contains(ev[0], other) {
				t.Errorf("event %q does not say the entry is in %s", ev[0], other)
			}
			if n := strings.Count(r.log.String(), "is invalid, left alone"); n != 1 {
				t.Errorf("%d log lines about the invalid file, want 1 per episode:\n%s", n, r.log.String())
			}
			if v := promtestutil.ToFloat64(r.a.Metrics.ConfigInvalidEpisodes.WithLabelValues("10-calico.conflist")); v != 1 {
				t.Errorf("episodes counter %v, want 1", v)
			}

			// Whole again, without meshcni's entry: the agent puts it back.
			if err := os.WriteFile(primary, []byte(calico), 0o644); err != nil {
				t.Fatal(err)
			}
			eventually(t, 5*time.Second, "entry back in the primary", func() error {
				if !hasEntry(primary) {
					return errors.New("no entry")
				}
				if tc.other && hasEntry(other) {
					return errors.New("entry still in the later list")
				}
				if n := promtestutil.CollectAndCount(r.a.Metrics.ConfigInvalid); n != 0 {
					return fmt.Errorf("%d invalid gauges left", n)
				}
				return r.a.Guard.Ready()
			})
			if tc.other {
				if got, _ := os.ReadFile(other); !strings.Contains(string(got), `"bridge": "cni0"`) {
					t.Errorf("later list lost its content: %s", got)
				}
			}
			if !strings.Contains(r.log.String(), "valid again") {
				t.Error("the end of the episode is not logged")
			}
			if ev := r.rec.all(); len(ev) != 1 {
				t.Errorf("events after recovery = %q, want still one", ev)
			}
		})
	}
}

// TestUninstallKeepsPluginForInvalidList: the agent stops (uninstall) while the
// primary is half-written and may hold meshcni's entry once complete: the binary and
// kubeconfig stay, the file is not touched, and the stop reports why.
func TestUninstallKeepsPluginForInvalidList(t *testing.T) {
	e := newEnv(t)
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	if err := os.WriteFile(primary, []byte(calico), 0o644); err != nil {
		t.Fatal(err)
	}
	r := startAgent(t, e.args("--keep-on-exit=never"), nil)
	eventually(t, 5*time.Second, "ready", r.a.Guard.Ready)
	whole, err := os.ReadFile(primary)
	if err != nil {
		t.Fatal(err)
	}
	half := whole[:len(whole)/2]
	if err := os.WriteFile(primary, half, 0o644); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "invalid file noticed", func() error {
		if v := promtestutil.ToFloat64(r.a.Metrics.ConfigInvalid.WithLabelValues("10-calico.conflist")); v != 1 {
			return fmt.Errorf("gauge %v", v)
		}
		return nil
	})
	err = r.stop()
	if !errors.Is(err, install.ErrInvalid) || !strings.Contains(err.Error(), primary) {
		t.Errorf("stop = %v, want an ErrInvalid naming %s", err, primary)
	}
	if got, _ := os.ReadFile(primary); !bytes.Equal(got, half) {
		t.Errorf("the half-written primary was written on uninstall:\n%s", got)
	}
	for _, p := range []string{filepath.Join(e.binDir, "meshcni"), filepath.Join(e.runDir, KubeconfigName)} {
		if _, err := os.Stat(p); err != nil {
			t.Errorf("%s removed although the invalid primary may hold meshcni's entry: %v", p, err)
		}
	}
}
