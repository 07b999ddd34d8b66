// Package backend defines how a ruleset reaches a network namespace, and chooses
// among the implementations: iptables-legacy and iptables-nft (one *-restore per
// family, pkg/backend/iptables) and native nftables over netlink (no exec,
// pkg/backend/nftables).
package backend

import (
	"context"
	"fmt"
	"strings"

	"github.com/meshcni/meshcni/pkg/rules"
)

// Kind names a backend.
type Kind string

const (
	Auto           Kind = "auto"
	IptablesLegacy Kind = "iptables-legacy"
	IptablesNft    Kind = "iptables-nft"
	Nftables       Kind = "nftables"
)

// ParseKind parses a backend name ("" means auto).
func ParseKind(s string) (Kind, error) {
	switch k := Kind(strings.ToLower(strings.TrimSpace(s))); k {
	case "":
		return Auto, nil
	case Auto, IptablesLegacy, IptablesNft, Nftables:
		return k, nil
	}
	return "", fmt.Errorf("invalid backend %q: want auto, nftables, iptables-nft or iptables-legacy", s)
}

// Backend writes, compares and removes meshcni's rules in one network namespace.
// NetnsPath "" means the caller's current namespace (for use as an init container).
//
// Apply is atomic: on error the namespace's tables are as they were before. It is
// idempotent: applying the same ruleset twice leaves the same state as once, and
// applying a different one replaces what meshcni had written.
type Backend interface {
	Kind() Kind
	Apply(ctx context.Context, netnsPath string, rs *rules.Ruleset) error
	// Check compares the live rules with the desired ones and reports the drift.
	Check(ctx context.Context, netnsPath string, rs *rules.Ruleset) (Drift, error)
	// Clean removes exactly what meshcni writes and nothing else. Cleaning a clean
	// namespace is not an error.
	Clean(ctx context.Context, netnsPath string) error
	// Live returns meshcni's live rules in the backend's own text form (for
	// `meshcnictl inspect`).
	Live(ctx context.Context, netnsPath string) (string, error)
}

// Drift lists rules, in the backend's text form, that are missing from the live
// state or present there without being desired. Each string names its table and
// chain.
type Drift struct {
	Missing    []string
	Unexpected []string
}

// Empty reports whether live equals desired.
func (d Drift) Empty() bool { return len(d.Missing) == 0 && len(d.Unexpected) == 0 }

func (d Drift) String() string {
	if d.Empty() {
		return "no drift"
	}
	var sb strings.Builder
	for _, m := range d.Missing {
		fmt.Fprintf(&sb, "missing:    %s\n", m)
	}
	for _, u := range d.Unexpected {
		fmt.Fprintf(&sb, "unexpected: %s\n", u)
	}
	return strings.TrimRight(sb.String(), "\n")
}
