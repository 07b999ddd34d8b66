package agentsock

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"sync"
)

// Handler returns a slog.Handler that sends records at level or above to the agent.
// While the agent is unreachable, records go to fallback (when not nil). Attributes
// named KeyPodNamespace and KeyPodName fill the record's pod.
func (c *Client) Handler(level slog.Leveler, fallback slog.Handler) slog.Handler {
	if level == nil {
		level = slog.LevelInfo
	}
	h := &handler{c: c, level: level}
	if fallback != nil {
		h.fallback = &lazyHandler{root: fallback}
	}
	return h
}

type handler struct {
	c        *Client
	level    slog.Leveler
	fallback *lazyHandler
	attrs    []slog.Attr // already prefixed with groups
	group    string      // "a.b." prefix of later attributes
}

// lazyHandler is the fallback handler with the handler's WithAttrs and WithGroup
// applied only when a record first goes to it: the plugin adds its attributes to every
// logger, and a slog.TextHandler formats them at once, but most runs log nothing or
// only to the agent.
type lazyHandler struct {
	root   slog.Handler // the fallback given to Handler
	parent *lazyHandler // nil at the root
	attrs  []slog.Attr  // WithAttrs(attrs), when group is ""
	group  string       // WithGroup(group)
	once   sync.Once
	h      slog.Handler
}

func (l *lazyHandler) get() slog.Handler {
	l.once.Do(func() {
		switch {
		case l.parent == nil:
			l.h = l.root
		case l.group != "":
			l.h = l.parent.get().WithGroup(l.group)
		default:
			l.h = l.parent.get().WithAttrs(l.attrs)
		}
	})
	return l.h
}

// enabled asks the root first, so that a level the fallback does not log derives
// nothing (slog's handlers share their level with the handlers they derive).
func (l *lazyHandler) enabled(ctx context.Context, lv slog.Level) bool {
	return l != nil && l.root.Enabled(ctx, lv) && l.get().Enabled(ctx, lv)
}

func (h *handler) Enabled(ctx context.Context, l slog.Level) bool {
	if l >= h.level.Level() {
		return true
	}
	return h.fallback.enabled(ctx, l)
}

func (h *handler) Handle(ctx context.Context, r slog.Record) error {
	if r.Level < h.level.Level() || !h.c.Connected() {
		if h.fallback.enabled(ctx, r.Level) {
			return h.fallback.get().Handle(ctx, r)
		}
		return nil
	}
	rec := &LogRecord{Time: r.Time, Level: r.Level.String(), Msg: r.Message}
	add := func(a slog.Attr, prefix string) {
		addAttr(rec, a, prefix)
	}
	for _, a := range h.attrs {
		add(a, "")
	}
	r.Attrs(func(a slog.Attr) bool {
		add(a, h.group)
		return true
	})
	if err := h.c.send(&Message{Kind: KindLog, Log: rec}); err != nil && h.fallback != nil {
		return h.fallback.get().Handle(ctx, r)
	}
	return nil
}

func addAttr(rec *LogRecord, a slog.Attr, prefix string) {
	v := a.Value.Resolve()
	if a.Key == "" && v.Kind() != slog.KindGroup {
		return
	}
	if v.Kind() == slog.KindGroup {
		p := prefix
		if a.Key != "" {
			p = prefix + a.Key + "."
		}
		for _, g := range v.Group() {
			addAttr(rec, g, p)
		}
		return
	}
	key := prefix + a.Key
	switch key {
	case KeyPodNamespace:
		rec.Pod.Namespace = v.String()
		return
	case KeyPodName:
		rec.Pod.Name = v.String()
		return
	}
	if rec.Attrs == nil {
		rec.Attrs = map[string]any{}
	}
	rec.Attrs[key] = jsonValue(v)
}

func jsonValue(v slog.Value) any {
	switch v.Kind() {
	case slog.KindString:
		return v.String()
	case slog.KindInt64:
		return v.Int64()
	case slog.KindUint64:
		return v.Uint64()
	case slog.KindFloat64:
		return v.Float64()
	case slog.KindBool:
		return v.Bool()
	case slog.KindDuration:
		return v.Duration().String()
	case slog.KindTime:
		return v.Time()
	}
	switch x := v.Any().(type) {
	case error:
		return x.Error()
	case fmt.Stringer:
		return x.String()
	case json.Marshaler:
		return x
	}
	return fmt.Sprint(v.Any())
}

func (h *handler) WithAttrs(attrs []slog.Attr) slog.Handler {
	h2 := *h
	h2.attrs = make([]slog.Attr, len(h.attrs), len(h.attrs)+len(attrs))
	copy(h2.attrs, h.attrs)
	for _, a := range attrs {
		if h.group != "" {
			a.Key = h.group + a.Key
		}
		h2.attrs = append(h2.attrs, a)
	}
	if h.fallback != nil {
		// Values are resolved now, as slog's handlers do in WithAttrs.
		fa := make([]slog.Attr, len(attrs))
		for i, a := range attrs {
			a.Value = a.Value.Resolve()
			fa[i] = a
		}
		h2.fallback = &lazyHandler{root: h.fallback.root, parent: h.fallback, attrs: fa}
	}
	return &h2
}

func (h *handler) WithGroup(name string) slog.Handler {
	if name == "" {
		return h
	}
	h2 := *h
	h2.group = h.group + name + "."
	if h.fallback != nil {
		h2.fallback = &lazyHandler{root: h.fallback.root, parent: h.fallback, group: name}
	}
	return &h2
}
