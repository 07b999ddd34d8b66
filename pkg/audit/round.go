package audit

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sort"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/capture/k8spod"
	"github.com/meshcni/meshcni/pkg/engine"
	"github.com/meshcni/meshcni/pkg/heal"
	"github.com/meshcni/meshcni/pkg/podnetns"
	"github.com/meshcni/meshcni/pkg/sandboxstate"
	"github.com/meshcni/meshcni/pkg/spec"
)

// Result is what auditing one pod came to.
type Result string

// The results, counted in Stats.
const (
	Skipped  Result = "skipped"  // not audited (not meshed, not running, busy, dropped)
	Clean    Result = "clean"    // the live redirect is the spec's
	Repaired Result = "repaired" // drift, re-applied in place
	Evicted  Result = "evicted"  // escaped, evicted
	Reported Result = "reported" // drift (or changed annotations), reported only
	Gone     Result = "gone"     // the namespace is gone: dropped
	Failed   Result = "failed"   // an error (logged, counted)
)

// Stats count the results of a round.
type Stats map[Result]int

// Round audits every pod now, at most Concurrency at a time, and waits for them.
func (a *Auditor) Round(ctx context.Context) Stats {
	return a.round(ctx, 0)
}

// round audits every listed pod, the starts spread evenly over spread.
func (a *Auditor) round(ctx context.Context, spread time.Duration) Stats {
	pods := a.o.Pods.List()
	a.prune(pods)
	sort.Slice(pods, func(i, j int) bool { return pods[i].UID < pods[j].UID })
	var (
		mu    sync.Mutex
		stats = Stats{}
		wg    sync.WaitGroup
		sem   = a.sem
	)
	step := time.Duration(0)
	if len(pods) > 0 {
		step = spread / time.Duration(len(pods))
	}
	for i, pod := range pods {
		if i > 0 && step > 0 && !sleep(ctx, step) {
			break
		}
		if !acquire(ctx, sem) {
			break
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			r := a.Pod(ctx, pod)
			mu.Lock()
			stats[r]++
			mu.Unlock()
		}()
	}
	wg.Wait()
	a.o.Metrics.Rounds.Inc()
	return stats
}

// acquire takes a slot of sem, unless ctx ends first (false: no slot taken).
func acquire(ctx context.Context, sem chan struct{}) bool {
	select {
	case sem <- struct{}{}:
		return true
	case <-ctx.Done():
		return false
	}
}

func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// jittered is the period varied by up to ±Jitter.
func jittered(p time.Duration) time.Duration {
	return p + time.Duration((rand.Float64()*2-1)*Jitter*float64(p))
}

// WaitForSync is what Run waits for before the first round (pkg/agent/nodepods.Cache).
type syncer interface {
	WaitForSync(ctx context.Context) bool
}

// Run audits at start (once the pod cache synced), then every period (jittered),
// and the pods whose containers start, until ctx ends.
func (a *Auditor) Run(ctx context.Context) error {
	if s, ok := a.o.Pods.(syncer); ok && !s.WaitForSync(ctx) {
		return nil
	}
	a.o.Log.Info(LogStarted, "period", a.o.Period.String(), "action", a.o.Action, "escaped_action", a.o.EscapedAction,
		"concurrency", a.o.Concurrency, "follow_annotations", a.o.FollowAnnotations)
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Add(1)
	go func() {
		defer wg.Done()
		a.triggered(ctx)
	}()
	a.logRound(a.Round(ctx))
	if a.o.Period == 0 {
		<-ctx.Done()
		return nil
	}
	next := time.Now()
	for {
		next = next.Add(jittered(a.o.Period))
		if d := time.Until(next); d > 0 && !sleep(ctx, d) {
			return nil
		} else if d <= 0 { // a round outlasted the period: start from now
			next = time.Now()
		}
		if ctx.Err() != nil {
			return nil
		}
		a.logRound(a.round(ctx, time.Duration(Spread*float64(a.o.Period))))
	}
}

func (a *Auditor) logRound(s Stats) {
	args := []any{}
	for _, r := range []Result{Clean, Repaired, Evicted, Reported, Gone, Failed, Skipped} {
		args = append(args, string(r), s[r])
	}
	a.o.Log.Debug(LogRound, args...)
}

// triggered audits the pods whose containers started, one at a time, within the
// concurrency rounds share.
func (a *Auditor) triggered(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case key := <-a.trigger:
			ns, name, _ := strings.Cut(key, "/")
			pod, ok := a.o.Pods.Get(ns, name)
			if !ok {
				continue
			}
			if !acquire(ctx, a.sem) {
				return
			}
			a.Pod(ctx, pod)
			<-a.sem
		}
	}
}

// Pod audits one pod: its spec, its namespace (entered once), the check, and the
// action on drift.
func (a *Auditor) Pod(ctx context.Context, pod *corev1.Pod) Result {
	cur, ok := a.o.Pods.Get(pod.Namespace, pod.Name) // deleted or changed since listed?
	if !ok || cur.UID != pod.UID {
		return Skipped
	}
	pod = cur
	if ok, _ := eligible(pod, a.o.Node); !ok {
		return Skipped
	}
	meshedNow, _ := Audited(pod, a.o.Node, a.o.Mesh)
	var recorded Decision
	why := ""
	if a.o.Decisions != nil {
		recorded, why = a.o.Decisions.Decided(pod)
	}
	verdict := Decided(recorded, meshedNow)
	if verdict == Skip {
		return Skipped
	}
	st := a.state(pod.UID)
	if !st.busy.TryLock() { // a round and a trigger at once: one is enough
		return Skipped
	}
	defer st.busy.Unlock()
	log := a.o.Log.With("pod_namespace", pod.Namespace, "pod_name", pod.Name, "pod_uid", string(pod.UID))
	if verdict == Change {
		return a.changedSinceAdd(pod, st, recorded, why, log)
	}
	st.recorded = recorded == sandboxstate.Meshed
	if st.gone {
		return Skipped
	}
	want, err := a.spec(pod)
	if err != nil {
		return a.fail(log, st, "spec", err)
	}
	a.recall(pod, st)
	target, changed := a.target(pod, st, want, log)
	h, err := a.netns(ctx, pod, st)
	if r := refusal(err); r != "" {
		return a.refuse(pod, st, log, r, err)
	}
	if errors.Is(err, podnetns.ErrNotFound) {
		st.gone = true
		log.Info(LogGone, "err", err)
		return Gone
	}
	if err != nil {
		return a.fail(log, st, "netns", err)
	}
	defer h.Close()
	o := engine.Options{Backend: a.o.Backend, NetnsPath: h.NetnsPath(), Logger: log}
	if (o.Backend == "" || o.Backend == backend.Auto) && st.kind != "" {
		o.Backend = st.kind // the backend that holds the pod's redirect: no probe
	}
	rep, err := a.o.Check(ctx, o, target)
	if err != nil {
		return a.fail(log, st, "check", err)
	}
	st.lastErr = ""
	if changed && a.o.FollowAnnotations {
		return a.follow(ctx, pod, st, o, want, rep, h.Path, log)
	}
	if rep.Empty() {
		st.reported, st.kind = "", rep.Backend
		if st.hash == "" {
			a.redirectedWith(pod, st, target)
		}
		if changed {
			return Reported
		}
		return Clean
	}
	return a.drift(ctx, pod, st, o, target, rep, h.Path, log)
}

// changedSinceAdd reports, once, a pod whose annotations disagree with what its
// sandbox's ADD decided; nothing is done (the running pod keeps what its ADD gave
// it; the new annotations apply when it is recreated).
func (a *Auditor) changedSinceAdd(pod *corev1.Pod, st *podState, recorded Decision, why string, log *slog.Logger) Result {
	now := "meshed"
	if recorded == sandboxstate.Meshed {
		now = "not meshed"
	}
	key := string(recorded) + "→" + now
	if st.changed == key {
		return Reported
	}
	st.changed = key
	a.o.Metrics.Detected.WithLabelValues(string(ReasonAnnotationsChanged)).Inc()
	msg := fmt.Sprintf("meshcni: the pod's annotations say %s, but its sandbox's ADD decided %s (%s); nothing is changed or deleted: the pod keeps what its ADD gave it until it is recreated", now, recorded, why)
	a.o.Events.Event(pod, corev1.EventTypeWarning, EventAnnotationsChanged, msg)
	log.Warn(LogChanged, "reason", ReasonAnnotationsChanged, "add_decision", recorded, "add_reason", why, "annotations", now)
	return Reported
}

// spec is the redirect the pod's annotations give today.
func (a *Auditor) spec(pod *corev1.Pod) (*spec.Spec, error) {
	ips, err := podnetns.PodIPs(pod)
	if err != nil {
		return nil, err
	}
	res, err := a.o.Mesh.ForPod(k8spod.From(pod), ips)
	if err != nil {
		return nil, fmt.Errorf("redirect spec: %w", err)
	}
	return res.Spec, nil
}

// recall takes the spec a pod this auditor has not seen yet was redirected with
// from Applied (the agent's memory of the sandbox's ADD).
func (a *Auditor) recall(pod *corev1.Pod, st *podState) {
	if st.hash != "" || a.o.Applied == nil {
		return
	}
	if s, ok := a.o.Applied.Applied(pod); ok && s != nil {
		st.spec, st.hash = s, Hash(s)
	}
}

// redirectedWith records s as the spec the pod is redirected with, here and in
// Applied.
func (a *Auditor) redirectedWith(pod *corev1.Pod, st *podState, s *spec.Spec) {
	st.spec, st.hash = s, Hash(s)
	if a.o.Applied != nil {
		a.o.Applied.Remember(pod, s)
	}
}

// target is the spec to check the pod against: the one it was redirected with,
// unless the annotations changed and are followed. A change not followed is
// reported once per new spec.
func (a *Auditor) target(pod *corev1.Pod, st *podState, want *spec.Spec, log *slog.Logger) (*spec.Spec, bool) {
	h := Hash(want)
	if st.hash == "" || st.hash == h {
		return want, false
	}
	if a.o.FollowAnnotations {
		return want, true
	}
	if st.changed != h {
		st.changed = h
		a.o.Metrics.Detected.WithLabelValues(string(ReasonAnnotationsChanged)).Inc()
		msg := "meshcni: the pod's traffic annotations changed since its redirect was written; the running pod keeps its redirect (as Istio does), the new one applies when the pod is recreated (the agent's --audit-follow-annotations applies it in place)"
		a.o.Events.Event(pod, corev1.EventTypeWarning, EventAnnotationsChanged, msg)
		log.Warn(LogChanged, "reason", ReasonAnnotationsChanged, "spec", h, "redirected_with", st.hash)
	}
	return st.spec, true
}

// netns opens the pod's namespace: by the path it was located through when that
// still leads to the same namespace (device, inode and cookie), else by locating
// it again (Options.Netns: by its sandbox).
func (a *Auditor) netns(ctx context.Context, pod *corev1.Pod, st *podState) (*podnetns.Handle, error) {
	if st.path != "" {
		if h, err := podnetns.Open(st.path); err == nil {
			if id, err := h.Cookied(); err == nil && id == st.id {
				return h, nil
			}
			h.Close()
		}
		st.path = ""
	}
	h, err := a.o.Netns.Locate(ctx, pod)
	if err != nil {
		return nil, err
	}
	if id, err := h.Cookied(); err == nil && id.Cookie != 0 {
		st.path, st.id = h.Path, id
	}
	return h, nil
}

// refuse reports a pod whose namespace is not verified to be its sandbox's: an
// Event once per distinct cause, the Refused metric, a log line; nothing is done.
func (a *Auditor) refuse(pod *corev1.Pod, st *podState, log *slog.Logger, reason string, err error) Result {
	a.o.Metrics.Refused.WithLabelValues(reason).Inc()
	if msg := "refused: " + err.Error(); msg != st.lastErr {
		st.lastErr = msg
		a.o.Events.Event(pod, corev1.EventTypeWarning, EventRefused, "meshcni: "+err.Error()+"; nothing was changed or deleted")
		log.Warn(LogRefused, "reason", reason, "err", err)
	} else {
		log.Debug(LogRefused, "reason", reason, "err", err)
	}
	return Reported
}

// fail counts an error and logs it: at Warn the first time, at Debug while it repeats.
func (a *Auditor) fail(log *slog.Logger, st *podState, stage string, err error) Result {
	a.o.Metrics.Errors.WithLabelValues(stage).Inc()
	if msg := stage + ": " + err.Error(); msg != st.lastErr {
		st.lastErr = msg
		log.Warn(LogError, "stage", stage, "err", err)
	} else {
		log.Debug(LogError, "stage", stage, "err", err)
	}
	return Failed
}

// follow applies the changed annotations' spec in place.
func (a *Auditor) follow(ctx context.Context, pod *corev1.Pod, st *podState, o engine.Options, want *spec.Spec, rep engine.Report, where string, log *slog.Logger) Result {
	reason := ReasonAnnotationsChanged
	a.o.Metrics.Detected.WithLabelValues(string(reason)).Inc()
	kind, err := a.o.Apply(ctx, o, want)
	if err != nil {
		return a.actionFailed(pod, st, log, fmt.Errorf("apply the changed annotations' redirect in %s: %w", where, err))
	}
	a.redirectedWith(pod, st, want)
	st.changed = ""
	a.o.Metrics.Repaired.WithLabelValues(string(reason)).Inc()
	msg := fmt.Sprintf("meshcni applied the pod's changed traffic annotations in place (backend %s, netns %s): %s", kind, where, rep.Describe())
	a.o.Events.Event(pod, corev1.EventTypeWarning, EventDrift, msg)
	log.Warn(LogDrift, "reason", reason, "action", ActionRepair, "backend", kind, "netns", where)
	return Repaired
}

// drift handles a report that differs: the judgement, the action, the Event, the
// metrics and one log line per finding.
func (a *Auditor) drift(ctx context.Context, pod *corev1.Pod, st *podState, o engine.Options, target *spec.Spec, rep engine.Report, where string, log *slog.Logger) Result {
	absent := false
	if Absent(rep) {
		absent = a.noRules(ctx, o)
	}
	j := Judge(rep, absent, HasInitContainer(pod, a.o.InitContainer), st.recorded, a.o.Action, a.o.EscapedAction)
	desc := rep.Describe()
	if j.Escaped {
		desc = fmt.Sprintf("no meshcni redirect at all and no %s init container: the pod's sandbox was created while meshcni was not in the node's CNI chain", a.o.InitContainer)
	}
	if (j.Action == ActionReport || j.Action == ActionEvict) && st.reported == desc {
		return Reported // reported (or its eviction refused) already: not every round
	}
	for _, r := range j.Reasons {
		a.o.Metrics.Detected.WithLabelValues(string(r)).Inc()
	}
	msg, result, err := a.act(ctx, pod, o, target, j, where)
	if err != nil {
		return a.actionFailed(pod, st, log, err)
	}
	st.reported = ""
	if result == Reported {
		st.reported = desc
	} else {
		for _, r := range j.Reasons {
			a.o.Metrics.Repaired.WithLabelValues(string(r)).Inc()
		}
	}
	if result == Repaired && st.hash == "" {
		a.redirectedWith(pod, st, target)
	}
	reason, logMsg := EventDrift, LogDrift
	if j.Escaped {
		reason, logMsg = EventEscaped, LogEscaped
	}
	a.o.Events.Event(pod, corev1.EventTypeWarning, reason, "meshcni: "+desc+"; "+msg)
	if j.Escaped {
		log.Warn(logMsg, "reason", ReasonNoRedirect, "action", j.Action, "netns", where)
	} else {
		for _, f := range rep.Findings {
			log.Warn(logMsg, "reason", f.Reason, "where", f.Where, "missing", f.Missing, "unexpected", f.Unexpected,
				"backend", rep.Backend, "action", j.Action, "netns", where)
		}
	}
	return result
}

// noRules reports whether the namespace holds no meshcni rule in any backend.
func (a *Auditor) noRules(ctx context.Context, o engine.Options) bool {
	o.Backend = "" // every backend
	live, err := a.o.Live(ctx, o)
	if err != nil {
		return false
	}
	for _, txt := range live {
		if strings.TrimSpace(txt) != "" {
			return false
		}
	}
	return true
}

// act runs the judged action and says what it did.
func (a *Auditor) act(ctx context.Context, pod *corev1.Pod, o engine.Options, target *spec.Spec, j Judgement, where string) (string, Result, error) {
	switch j.Action {
	case ActionReport:
		return "reported only, nothing changed (the agent's audit action is report)", Reported, nil
	case ActionRepair:
		kind, err := a.o.Apply(ctx, o, target)
		if err != nil {
			return "", Failed, fmt.Errorf("re-apply the redirect in %s: %w", where, err)
		}
		return fmt.Sprintf("redirect re-applied in place (backend %s, netns %s)", kind, where), Repaired, nil
	case ActionEvict:
		err := a.evict(ctx, pod)
		if r, ok := heal.IsRefused(err); ok {
			return "not evicted: " + r.Error() + "; nothing changed", Reported, nil
		}
		if err != nil {
			return "", Failed, err
		}
		return "pod evicted: its controller recreates it through meshcni's plugin", Evicted, nil
	}
	return "", Failed, fmt.Errorf("unknown action %q", j.Action)
}

func (a *Auditor) evict(ctx context.Context, pod *corev1.Pod) error {
	if a.o.ReadyToDelete != nil {
		if err := a.o.ReadyToDelete(); err != nil {
			return fmt.Errorf("not evicting: the plugin is not installed yet: %w", err)
		}
	}
	if a.o.Evictor == nil {
		return errors.New("not evicting: no Kubernetes API access")
	}
	return a.o.Evictor.Evict(ctx, pod)
}

// actionFailed reports a failed action (Event once per distinct error).
func (a *Auditor) actionFailed(pod *corev1.Pod, st *podState, log *slog.Logger, err error) Result {
	if msg := "action: " + err.Error(); msg != st.lastErr {
		a.o.Events.Event(pod, corev1.EventTypeWarning, EventFailed, "meshcni: "+err.Error())
	}
	a.fail(log, st, "action", err)
	log.Debug(LogFailed, "err", err)
	return Failed
}
