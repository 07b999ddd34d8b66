package capture

import (
	"strings"

	"github.com/meshcni/meshcni/pkg/spec"
)

// AnnotationEBPFAcceleration is meshcni's own: whether the hop between the pod's
// app and its proxy is accelerated by eBPF (docs/ebpf.md), overriding the node
// agent's default.
const AnnotationEBPFAcceleration = "meshcni.io/ebpf-acceleration"

// Acceleration is a pod's eBPF acceleration of the app ↔ proxy hop.
type Acceleration string

const (
	// AccelDefault (no annotation): the node agent's default for the pod's namespace.
	AccelDefault Acceleration = ""
	// AccelOff: never accelerated.
	AccelOff Acceleration = "off"
	// AccelToProxy accelerates what the app sends to its proxy; the proxy's bytes
	// reach the app through TCP (safe for apps that read with splice(2)).
	AccelToProxy Acceleration = "to-proxy"
	// AccelBoth accelerates both directions.
	AccelBoth Acceleration = "both"
)

// ParseAcceleration parses off, to-proxy or both (case-insensitive, surrounding
// spaces ignored); anything else, "" included, is a *spec.FieldError naming field.
func ParseAcceleration(field, s string) (Acceleration, error) {
	switch a := Acceleration(strings.ToLower(strings.TrimSpace(s))); a {
	case AccelOff, AccelToProxy, AccelBoth:
		return a, nil
	}
	return "", &spec.FieldError{Field: field, Value: s, Reason: "want off, to-proxy or both"}
}

// On reports whether a is to-proxy or both.
func (a Acceleration) On() bool { return a == AccelToProxy || a == AccelBoth }

// acceleration is the pod's annotation, AccelDefault without one.
func acceleration(ann map[string]string) (Acceleration, error) {
	v, ok := ann[AnnotationEBPFAcceleration]
	if !ok {
		return AccelDefault, nil
	}
	return ParseAcceleration(AnnotationEBPFAcceleration, v)
}
