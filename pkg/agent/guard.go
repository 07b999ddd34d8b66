package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/fsnotify/fsnotify"

	"github.com/meshcni/meshcni/pkg/install"
)

// Guard installs the plugin's binary, kubeconfig and configuration, and keeps them in
// place: it watches the CNI configuration directory, the binary's directory and the
// kubeconfig's sources, and reconciles on changes (debounced), with a periodic resync.
// When another writer keeps removing meshcni's entry it backs off exponentially and
// reports the conflict instead of looping. A configuration file that does not load
// (left half-written by another writer) is never written: the guard reports it once
// per episode and picks up again when the file is valid.
type Guard struct {
	Conf       install.ConflistOptions
	Binary     *install.Binary
	Kubeconfig *install.Kubeconfig

	Debounce          time.Duration
	Resync            time.Duration
	ConflictThreshold int // 0: never back off
	ConflictWindow    time.Duration
	BackoffMax        time.Duration

	Log      *slog.Logger
	Metrics  *Metrics
	Recorder Recorder

	mu          sync.Mutex
	lastErr     map[part]string // last error logged per part, to log changes only
	installed   bool            // the entry was in place once
	reinjected  []time.Time     // recent re-injections
	backoff     time.Duration
	notBefore   time.Time
	inConflict  bool
	lastPrimary string
	invalid     map[string]bool // configuration files found invalid, until valid again
	kick        chan struct{}   // KubeconfigChanged's signal to Run
}

type part int

const (
	partBinary part = 1 << iota
	partKubeconfig
	partConf
	partAll = partBinary | partKubeconfig | partConf
)

func (p part) String() string {
	var s []string
	for _, x := range []struct {
		p part
		n string
	}{{partBinary, "binary"}, {partKubeconfig, "kubeconfig"}, {partConf, "config"}} {
		if p&x.p != 0 {
			s = append(s, x.n)
		}
	}
	return strings.Join(s, "+")
}

// Name implements Runnable.
func (g *Guard) Name() string { return "guard" }

func (g *Guard) kicks() chan struct{} {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.kick == nil {
		g.kick = make(chan struct{}, 1)
	}
	return g.kick
}

// KubeconfigChanged tells Run that the kubeconfig's source changed without a file event
// (a token minted in memory): the kubeconfig, then the configuration, are reconciled
// after the debounce.
func (g *Guard) KubeconfigChanged() {
	select {
	case g.kicks() <- struct{}{}:
	default: // one pending signal is enough
	}
}

// Ready checks, live, that the binary, kubeconfig and configuration entry are in place
// and valid. It updates the ready gauge.
func (g *Guard) Ready() error {
	var errs []error
	if err := g.Binary.Check(); err != nil {
		errs = append(errs, fmt.Errorf("binary: %w", err))
	}
	if err := g.Kubeconfig.Check(); err != nil {
		errs = append(errs, fmt.Errorf("kubeconfig: %w", err))
	}
	if _, err := install.CheckConflist(g.Conf); err != nil {
		errs = append(errs, fmt.Errorf("config: %w", err))
	}
	err := errors.Join(errs...)
	if g.Metrics != nil {
		if err == nil {
			g.Metrics.Ready.Set(1)
		} else {
			g.Metrics.Ready.Set(0)
		}
	}
	return err
}

// watchSet maps the watched directories to what their events concern.
type watchSet struct {
	w       *fsnotify.Watcher
	dirs    map[string]bool // watched (true) or still missing (false)
	binDsts map[string]bool // the plugin binary and its companions
	kubeDst string
	confDir string
	kubeSrc map[string]bool
}

func (ws *watchSet) addMissing(log *slog.Logger) {
	for d, ok := range ws.dirs {
		if ok {
			continue
		}
		if err := ws.w.Add(d); err == nil {
			ws.dirs[d] = true
			log.Debug("watching", "dir", d)
		}
	}
}

func (ws *watchSet) missing() bool {
	for _, ok := range ws.dirs {
		if !ok {
			return true
		}
	}
	return false
}

// classify says which parts an event may concern.
func (ws *watchSet) classify(ev fsnotify.Event) part {
	var p part
	dir := filepath.Dir(ev.Name)
	base := filepath.Base(ev.Name)
	if dir == ws.confDir {
		if ext := filepath.Ext(base); (ext == ".conf" || ext == ".conflist" || ext == ".json") && !strings.HasPrefix(base, ".") {
			p |= partConf
		}
	}
	if ws.binDsts[ev.Name] {
		p |= partBinary
	}
	if ev.Name == ws.kubeDst || ws.kubeSrc[dir] {
		p |= partKubeconfig
	}
	// A watched directory itself removed or renamed: re-add it later, reconcile all.
	if _, ok := ws.dirs[ev.Name]; ok && ev.Has(fsnotify.Remove|fsnotify.Rename) {
		ws.dirs[ev.Name] = false
		p |= partAll
	}
	return p
}

// Run installs everything, then guards it until ctx ends.
func (g *Guard) Run(ctx context.Context) error {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return fmt.Errorf("file watcher: %w", err)
	}
	defer w.Close()
	ws := &watchSet{
		w:       w,
		dirs:    map[string]bool{},
		binDsts: map[string]bool{},
		kubeDst: g.Kubeconfig.Path,
		confDir: filepath.Clean(g.Conf.Dir),
		kubeSrc: map[string]bool{},
	}
	for _, d := range g.Binary.Dsts() {
		ws.binDsts[d] = true
	}
	for _, d := range append([]string{ws.confDir, filepath.Dir(g.Binary.Dst), filepath.Dir(ws.kubeDst)}, g.Kubeconfig.Source.WatchDirs()...) {
		ws.dirs[filepath.Clean(d)] = false
	}
	for _, d := range g.Kubeconfig.Source.WatchDirs() {
		ws.kubeSrc[filepath.Clean(d)] = true
	}
	ws.addMissing(g.Log)

	g.reconcile(partAll)

	debounce := time.NewTimer(time.Hour)
	debounce.Stop()
	armed := false
	var dirty part
	resync := time.NewTicker(g.Resync)
	defer resync.Stop()
	poll := time.NewTicker(time.Second) // re-adds missing directories
	defer poll.Stop()
	kick := g.kicks()

	arm := func() {
		d := g.Debounce
		g.mu.Lock()
		if wait := time.Until(g.notBefore); dirty&partConf != 0 && wait > d {
			d = wait
		}
		g.mu.Unlock()
		if !armed {
			debounce.Reset(d)
			armed = true
		}
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case ev, ok := <-w.Events:
			if !ok {
				return errors.New("file watcher closed")
			}
			if p := ws.classify(ev); p != 0 {
				g.Log.Debug("file event", "path", ev.Name, "op", ev.Op.String(), "parts", p.String())
				dirty |= p
				arm()
			}
		case err, ok := <-w.Errors:
			if !ok {
				return errors.New("file watcher closed")
			}
			// An overflow loses events: reconcile everything.
			g.Log.Warn("file watcher", "err", err)
			dirty |= partAll
			arm()
		case <-debounce.C:
			armed = false
			p := dirty
			dirty = 0
			if d := g.reconcile(p); d > 0 {
				dirty |= partConf // backed off: try again later
				arm()
			}
		case <-kick:
			dirty |= partKubeconfig | partConf
			arm()
		case <-resync.C:
			dirty |= partAll
			arm()
		case <-poll.C:
			if ws.missing() {
				ws.addMissing(g.Log)
				dirty |= partAll
				arm()
			}
		}
	}
}

// reconcile repairs the given parts. It returns a wait > 0 when the configuration part
// was postponed by the conflict backoff.
func (g *Guard) reconcile(p part) time.Duration {
	var wait time.Duration
	if p&partConf != 0 {
		g.mu.Lock()
		wait = time.Until(g.notBefore)
		g.mu.Unlock()
		if wait > 0 {
			p &^= partConf
		}
	}
	g.reconcileParts(p)
	g.Ready()
	return max(wait, 0)
}

func (g *Guard) reconcileParts(p part) {
	if p&partBinary != 0 {
		changed, err := g.Binary.Install()
		g.outcome(partBinary, changed, err, "plugin binary installed", "path", g.Binary.Dst)
	}
	if p&partKubeconfig != 0 {
		changed, err := g.Kubeconfig.Install()
		g.outcome(partKubeconfig, changed, err, "plugin kubeconfig written", "path", g.Kubeconfig.Path)
	}
	if p&partConf != 0 {
		// An entry whose binary or kubeconfig is missing would fail every pod's
		// CNI ADD on the node: the configuration is touched only once both are in.
		if g.Binary.Check() != nil || g.Kubeconfig.Check() != nil {
			g.Log.Debug("CNI configuration left alone until the binary and kubeconfig are in place")
			return
		}
		g.reconcileConf()
	}
}

func (g *Guard) outcome(p part, changed bool, err error, msg string, args ...any) {
	g.mu.Lock()
	if g.lastErr == nil {
		g.lastErr = map[part]string{}
	}
	prev := g.lastErr[p]
	if err != nil {
		g.lastErr[p] = err.Error()
	} else {
		delete(g.lastErr, p)
	}
	g.mu.Unlock()
	switch {
	case errors.Is(err, install.ErrNoToken):
		if err.Error() != prev {
			g.Log.Info("waiting for the plugin's token before writing its kubeconfig")
		}
	case err != nil:
		g.Metrics.Installs.WithLabelValues("error").Inc()
		if err.Error() != prev { // log each new problem once, not every resync
			g.Log.Error("install "+p.String(), "err", err)
		}
	case changed:
		g.Metrics.Installs.WithLabelValues("success").Inc()
		g.Log.Info(msg, args...)
	case prev != "":
		g.Log.Info(p.String()+" in place again", args...)
	}
}

func (g *Guard) reconcileConf() {
	res, err := install.InstallConflist(g.Conf)
	// Skipped is complete once the directory was read: on success, with no primary,
	// or with the named primary invalid (another error says nothing of the files).
	if pinned := errors.Is(err, install.ErrInvalid); err == nil || pinned || errors.Is(err, install.ErrNoPrimary) {
		g.noteInvalid(res.Skipped, res.Path, pinned)
	}
	if errors.Is(err, install.ErrInvalid) || errors.Is(err, install.ErrNoPrimary) && len(res.Skipped) > 0 {
		return // reported by noteInvalid; nothing written
	}
	if errors.Is(err, install.ErrNoPrimary) {
		g.mu.Lock()
		if g.lastErr == nil {
			g.lastErr = map[part]string{}
		}
		first := g.lastErr[partConf] != err.Error()
		g.lastErr[partConf] = err.Error()
		g.mu.Unlock()
		if first {
			g.Log.Info("waiting for the primary CNI configuration", "dir", g.Conf.Dir, "file", g.Conf.FileName)
		}
		return
	}
	if err != nil {
		g.outcome(partConf, false, err, "")
		return
	}
	args := []any{"path", res.Path}
	if res.Converted != "" {
		args = append(args, "converted_from", res.Converted)
	}
	if len(res.Cleaned) > 0 {
		args = append(args, "cleaned", res.Cleaned)
	}
	msg := "meshcni entry installed"
	g.mu.Lock()
	reinjection := g.installed && res.Changed && res.Missing
	g.installed = true
	g.lastPrimary = res.Path
	g.mu.Unlock()
	if reinjection {
		msg = "meshcni entry put back"
		g.Metrics.Reinjections.Inc()
		g.noteReinjection(res.Path)
	} else if res.Changed && !res.Missing {
		msg = "meshcni entry updated"
	}
	g.outcome(partConf, res.Changed, nil, msg, args...)
}

// noteReinjection counts re-injections in the window; past the threshold another
// writer is fighting us: back off exponentially and report it.
func (g *Guard) noteReinjection(file string) {
	if g.ConflictThreshold <= 0 {
		return
	}
	now := time.Now()
	g.mu.Lock()
	recent := g.reinjected[:0]
	for _, t := range g.reinjected {
		if now.Sub(t) < g.ConflictWindow {
			recent = append(recent, t)
		}
	}
	recent = append(recent, now)
	g.reinjected = recent
	n := len(recent)
	if n < g.ConflictThreshold {
		if n == 1 {
			g.backoff, g.inConflict = 0, false
		}
		g.mu.Unlock()
		return
	}
	if g.backoff == 0 {
		g.backoff = 100 * time.Millisecond
	} else {
		g.backoff = min(2*g.backoff, g.BackoffMax)
	}
	g.notBefore = now.Add(g.backoff)
	backoff := g.backoff
	first := !g.inConflict
	g.inConflict = true
	g.mu.Unlock()

	others := otherFiles(filepath.Dir(file), file)
	g.Metrics.Conflicts.WithLabelValues(filepath.Base(file)).Inc()
	g.Log.Warn("another writer keeps removing meshcni's entry; backing off",
		"file", file, "other_files", others, "removals", n, "window", g.ConflictWindow, "backoff", backoff)
	if first && g.Recorder != nil {
		g.Recorder.Warning("ConfigConflict", fmt.Sprintf(
			"meshcni's CNI entry was removed from %s %d times in %v by another writer (other CNI configs: %s); backing off up to %v",
			file, n, g.ConflictWindow, strings.Join(others, ", "), g.BackoffMax))
	}
}

// noteInvalid tracks the configuration files that do not load (skipped: the runtime
// reads them before the primary, or the named primary itself). A file's episode
// starts when it is first found invalid: one warning, one Event, the episode counter;
// the gauge is 1 until the file is valid again (or gone), which is logged once too.
func (g *Guard) noteInvalid(skipped []install.Skipped, primary string, pinned bool) {
	now := map[string]bool{}
	var started []install.Skipped
	g.mu.Lock()
	for _, s := range skipped {
		now[s.Path] = true
		if !g.invalid[s.Path] {
			started = append(started, s)
		}
	}
	var ended []string
	for p := range g.invalid {
		if !now[p] {
			ended = append(ended, p)
		}
	}
	g.invalid = now
	g.mu.Unlock()
	for _, s := range started {
		file := filepath.Base(s.Path)
		if g.Metrics != nil {
			g.Metrics.ConfigInvalid.WithLabelValues(file).Set(1)
			g.Metrics.ConfigInvalidEpisodes.WithLabelValues(file).Inc()
		}
		msg := invalidMessage(s, primary, pinned)
		g.Log.Warn(msg, "file", s.Path, "err", s.Err.Error(), "entry_in", primary)
		if g.Recorder != nil {
			g.Recorder.Warning("ConfigInvalid", msg)
		}
	}
	for _, p := range ended {
		if g.Metrics != nil {
			g.Metrics.ConfigInvalid.DeleteLabelValues(filepath.Base(p))
		}
		g.Log.Info("CNI configuration valid again (or removed); the agent manages the directory again", "file", p)
	}
}

// invalidMessage says what an invalid file means for the node's next pods and what
// the agent does about it.
func invalidMessage(s install.Skipped, primary string, pinned bool) string {
	msg := fmt.Sprintf("CNI configuration %s is invalid, left alone (%v): meshcni does not write it and removes nothing until it is valid again", s.Path, s.Err)
	switch {
	case pinned:
		return msg + "; it is the primary named by --cni-conf-file-name, so meshcni's entry stays where it is"
	case primary != "":
		return msg + fmt.Sprintf("; meshcni's entry is in %s, the next valid configuration, which CRI-O uses meanwhile (containerd starts no pod while an invalid file sorts first)", primary)
	default:
		return msg + "; no valid configuration follows it, so no pod can start on this node until it is valid"
	}
}

func otherFiles(dir, except string) []string {
	files, err := install.ListFiles(dir)
	if err != nil {
		return nil
	}
	var out []string
	for _, f := range files {
		if f != except {
			out = append(out, filepath.Base(f))
		}
	}
	return out
}

// Uninstall removes the configuration entry (or standalone list), the kubeconfig and
// the binary. A configuration list that does not parse may hold meshcni's entry
// unseen: the binary and kubeconfig that entry needs are then kept.
func (g *Guard) Uninstall() error {
	var errs []error
	changed, err := install.UninstallConflist(g.Conf)
	if err != nil {
		errs = append(errs, err)
	}
	for _, f := range changed {
		g.Log.Info("removed meshcni's configuration", "path", f)
	}
	if errors.Is(err, install.ErrInvalid) {
		g.Log.Warn("kept the plugin binary and kubeconfig: a CNI configuration list does not parse and may hold meshcni's entry; remove them by hand once it is valid and without the entry",
			"binary", g.Binary.Dst, "kubeconfig", g.Kubeconfig.Path, "err", err.Error())
		if g.Metrics != nil {
			g.Metrics.Ready.Set(0)
		}
		return errors.Join(errs...)
	}
	if err := g.Kubeconfig.Remove(); err != nil {
		errs = append(errs, err)
	}
	if err := g.Binary.Remove(); err != nil {
		errs = append(errs, err)
	}
	if g.Metrics != nil {
		g.Metrics.Ready.Set(0)
	}
	return errors.Join(errs...)
}
