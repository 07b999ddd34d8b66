// Package iptables applies meshcni's rules with iptables-legacy or iptables-nft:
// one iptables-save and one iptables-restore per IP family, run inside the pod's
// network namespace, never one exec per rule and no probing execs.
//
// Apply is atomic: iptables-restore (--noflush) replaces meshcni's chains and its
// rules in the kernel's chains in one input per family; if any family fails, every
// family already changed is restored from the snapshot taken just before, so the
// namespace is left as it was. The xtables lock is a private file per operation:
// a pod namespace never waits on the host-wide /run/xtables.lock.
package iptables

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sort"
	"strings"
	"sync"

	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/netnsutil"
	"github.com/meshcni/meshcni/pkg/rules"
	"github.com/meshcni/meshcni/pkg/rules/ipt"
)

// Backend is an iptables-legacy or iptables-nft backend.
type Backend struct {
	kind      backend.Kind
	dirs      []string // where the tools are looked up: ToolDirs
	maxOutput int      // a tool's standard output bound: MaxOutput
	mu        sync.Mutex
	bins      map[string]string // resolved program paths
}

// New returns a backend of kind backend.IptablesLegacy or backend.IptablesNft.
func New(kind backend.Kind) (*Backend, error) {
	if kind != backend.IptablesLegacy && kind != backend.IptablesNft {
		return nil, fmt.Errorf("iptables backend: unsupported kind %q", kind)
	}
	return &Backend{kind: kind, dirs: ToolDirs, maxOutput: MaxOutput, bins: map[string]string{}}, nil
}

// Kind implements backend.Backend.
func (b *Backend) Kind() backend.Kind { return b.kind }

// program returns the path of e.g. ip6tables-nft-restore.
func (b *Backend) program(family rules.Family, tool string) (string, error) {
	flavor := "nft"
	if b.kind == backend.IptablesLegacy {
		flavor = "legacy"
	}
	name := "iptables-" + flavor + tool
	if family == rules.V6 {
		name = "ip6tables-" + flavor + tool
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if p, ok := b.bins[name]; ok {
		return p, nil
	}
	p, err := lookTool(name, b.dirs)
	if err != nil {
		return "", fmt.Errorf("%s backend: %w", b.kind, err)
	}
	b.bins[name] = p
	return p, nil
}

// run executes one iptables tool in the namespace with a private xtables lock.
func (b *Backend) run(ctx context.Context, netns string, family rules.Family, tool string, stdin string, args ...string) (string, error) {
	prog, err := b.program(family, tool)
	if err != nil {
		return "", err
	}
	lock, err := os.CreateTemp("", "meshcni-xtables-*.lock")
	if err != nil {
		return "", fmt.Errorf("xtables lock file: %w", err)
	}
	lock.Close()
	defer os.Remove(lock.Name())
	env := []string{"XTABLES_LOCKFILE=" + lock.Name(), "PATH=/usr/sbin:/usr/bin:/sbin:/bin"}
	out, err := netnsutil.Exec(ctx, netns, strings.NewReader(stdin), env, b.maxOutput, prog, args...)
	return string(out), err
}

// Save returns iptables-save output of one family in the namespace.
func (b *Backend) Save(ctx context.Context, netns string, family rules.Family) (string, error) {
	return b.run(ctx, netns, family, "-save", "")
}

// plan builds the restore input that removes meshcni's current rules (as found in
// the snapshot) and writes the desired ones (desired "" = clean only).
func plan(snapshot []*savedTable, desired string) string {
	want := parseSave(desired)
	names := map[string]bool{}
	for _, t := range snapshot {
		names[t.Name] = true
	}
	for _, t := range want {
		names[t.Name] = true
	}
	var sb strings.Builder
	for _, table := range ipt.Tables {
		if !names[table] {
			continue
		}
		old := findTable(snapshot, table)
		nw := findTable(want, table)
		var body strings.Builder
		newChains := map[string]bool{}
		if nw != nil {
			for _, c := range nw.Chains {
				newChains[c] = true
			}
		}
		if old != nil {
			// Flush every owned chain that exists (":" in --noflush mode flushes).
			for _, c := range old.Chains {
				if ownedChain(c) {
					body.WriteString(":" + c + " - [0:0]\n")
				}
			}
			// Delete our rules from the kernel's chains, in reverse so positions hold.
			for _, c := range old.Chains {
				if ownedChain(c) {
					continue
				}
				rs := old.Rules[c]
				for i := len(rs) - 1; i >= 0; i-- {
					if ownedBuiltinRule(rs[i]) {
						body.WriteString("-D " + c + " " + rs[i] + "\n")
					}
				}
			}
			for _, c := range old.Chains {
				if ownedChain(c) && !newChains[c] {
					body.WriteString("-X " + c + "\n")
				}
			}
		}
		if nw != nil {
			oldChains := map[string]bool{}
			if old != nil {
				for _, c := range old.Chains {
					oldChains[c] = true
				}
			}
			for _, h := range nw.Header {
				name, _, _ := strings.Cut(h[1:], " ")
				if !oldChains[name] {
					body.WriteString(h + "\n")
				}
			}
			for _, c := range nw.Chains {
				for _, r := range nw.Rules[c] {
					body.WriteString("-A " + c + " " + r + "\n")
				}
			}
		}
		if body.Len() == 0 {
			continue
		}
		sb.WriteString("*" + table + "\n")
		sb.WriteString(body.String())
		sb.WriteString("COMMIT\n")
	}
	return sb.String()
}

// Apply implements backend.Backend.
func (b *Backend) Apply(ctx context.Context, netns string, rs *rules.Ruleset) error {
	return b.replace(ctx, netns, rs)
}

// Clean implements backend.Backend.
func (b *Backend) Clean(ctx context.Context, netns string) error {
	return b.replace(ctx, netns, nil)
}

// replace writes rs (nil: nothing) for every family, atomically across families.
func (b *Backend) replace(ctx context.Context, netns string, rs *rules.Ruleset) error {
	type done struct {
		family   rules.Family
		snapshot []*savedTable
		touched  []string
	}
	var applied []done
	rollback := func(cause error) error {
		var errs []error
		for _, d := range applied {
			if err := b.restoreSnapshot(ctx, netns, d.family, d.snapshot, d.touched); err != nil {
				errs = append(errs, fmt.Errorf("rollback %s: %w", d.family, err))
			}
		}
		return errors.Join(append([]error{cause}, errs...)...)
	}
	fams := []rules.Family{rules.V4, rules.V6}
	for _, fam := range fams {
		desired := ""
		if rs != nil {
			desired = ipt.Restore(rs, fam)
		}
		saved, err := b.Save(ctx, netns, fam)
		if err != nil {
			if rs == nil && !errors.Is(err, netnsutil.ErrOutputLimit) {
				continue // nothing to clean where the tool cannot even read
			}
			return rollback(fmt.Errorf("%s %s snapshot: %w", b.kind, fam, err))
		}
		snapshot := parseSave(saved)
		input := plan(snapshot, desired)
		if input == "" {
			continue
		}
		touched := tablesOf(input)
		// Record before running: a failed restore may have committed some tables.
		applied = append(applied, done{family: fam, snapshot: snapshot, touched: touched})
		if _, err := b.run(ctx, netns, fam, "-restore", input, "--noflush"); err != nil {
			return rollback(fmt.Errorf("%s %s restore: %w", b.kind, fam, err))
		}
	}
	return nil
}

func tablesOf(input string) []string {
	var ts []string
	for _, l := range strings.Split(input, "\n") {
		if strings.HasPrefix(l, "*") {
			ts = append(ts, l[1:])
		}
	}
	return ts
}

// restoreSnapshot puts the touched tables back exactly as saved (restore without
// --noflush replaces each listed table whole).
func (b *Backend) restoreSnapshot(ctx context.Context, netns string, fam rules.Family, snapshot []*savedTable, touched []string) error {
	var sb strings.Builder
	for _, name := range touched {
		if t := findTable(snapshot, name); t != nil {
			t.render(&sb)
		} else {
			// The table held nothing before: leave it empty.
			sb.WriteString("*" + name + "\nCOMMIT\n")
		}
	}
	_, err := b.run(ctx, netns, fam, "-restore", sb.String())
	return err
}

// ours extracts meshcni's chains and kernel-chain rules from a snapshot, as
// "table chain: rule" lines (sorted per chain order preserved).
func ours(snapshot []*savedTable) []string {
	var out []string
	for _, t := range snapshot {
		for _, c := range t.Chains {
			for _, r := range t.Rules[c] {
				if ownedChain(c) || ownedBuiltinRule(r) {
					out = append(out, t.Name+" "+c+": -A "+c+" "+r)
				}
			}
		}
	}
	return out
}

// Check implements backend.Backend: the desired rules are loaded into a scratch
// namespace and read back, so both sides are in the kernel's canonical form; the
// drift is the difference, rule by rule, per family.
func (b *Backend) Check(ctx context.Context, netns string, rs *rules.Ruleset) (backend.Drift, error) {
	var d backend.Drift
	want, err := b.canonical(ctx, rs)
	if err != nil {
		return d, err
	}
	for _, fam := range []rules.Family{rules.V4, rules.V6} {
		saved, err := b.Save(ctx, netns, fam)
		if err != nil {
			return d, fmt.Errorf("%s %s save: %w", b.kind, fam, err)
		}
		live := ours(parseSave(saved))
		m, u := diff(want[fam], live)
		for _, x := range m {
			d.Missing = append(d.Missing, fam.String()+" "+x)
		}
		for _, x := range u {
			d.Unexpected = append(d.Unexpected, fam.String()+" "+x)
		}
	}
	return d, nil
}

// Live implements backend.Backend.
func (b *Backend) Live(ctx context.Context, netns string) (string, error) {
	var sb strings.Builder
	for _, fam := range []rules.Family{rules.V4, rules.V6} {
		saved, err := b.Save(ctx, netns, fam)
		if err != nil {
			return "", fmt.Errorf("%s %s save: %w", b.kind, fam, err)
		}
		for _, l := range ours(parseSave(saved)) {
			sb.WriteString(fam.String() + " " + l + "\n")
		}
	}
	return sb.String(), nil
}

// diff compares two ordered rule lists chain by chain: a rule is missing or
// unexpected when its chain's sequence differs at that rule.
func diff(want, live []string) (missing, unexpected []string) {
	count := map[string]int{}
	for _, w := range want {
		count[w]++
	}
	for _, l := range live {
		count[l]--
	}
	keys := make([]string, 0, len(count))
	for k := range count {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		for n := count[k]; n > 0; n-- {
			missing = append(missing, k)
		}
		for n := count[k]; n < 0; n++ {
			unexpected = append(unexpected, k)
		}
	}
	if len(missing) == 0 && len(unexpected) == 0 && strings.Join(want, "\n") != strings.Join(live, "\n") {
		// Same rules, different order.
		for i := range want {
			if i >= len(live) || want[i] != live[i] {
				missing = append(missing, "(order) "+want[i])
				break
			}
		}
	}
	return missing, unexpected
}

// canonical loads the desired rules into a scratch namespace and reads back
// meshcni's rules per family in iptables-save's canonical form.
func (b *Backend) canonical(ctx context.Context, rs *rules.Ruleset) (map[rules.Family][]string, error) {
	out := map[rules.Family][]string{}
	err := netnsutil.InScratch(func() error {
		for _, fam := range []rules.Family{rules.V4, rules.V6} {
			if in := ipt.Restore(rs, fam); in != "" {
				if _, err := b.run(ctx, "", fam, "-restore", in, "--noflush"); err != nil {
					return fmt.Errorf("%s %s: desired rules do not load: %w", b.kind, fam, err)
				}
			}
			saved, err := b.Save(ctx, "", fam)
			if err != nil {
				return err
			}
			out[fam] = ours(parseSave(saved))
		}
		return nil
	})
	return out, err
}
