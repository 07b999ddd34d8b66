package iptables

import (
	"context"
	"net/netip"
	"strings"
	"testing"

	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/rules"
	"github.com/meshcni/meshcni/pkg/spec"
)

func fullSave(t *testing.T, b *Backend, ns string) string {
	t.Helper()
	return save(t, b, ns, rules.V4) + "--v6--\n" + save(t, b, ns, rules.V6)
}

// TestApplyAtomic injects a fault in the last table of the last family (a raw-table
// rule the kernel rejects) and asserts the namespace reads back exactly as before,
// both from empty and with meshcni's rules and a foreign rule already present.
func TestApplyAtomic(t *testing.T) {
	testutil.RequireRoot(t)
	good := spec.PodDefaults()
	good.EnableIPv6 = true
	bad := good
	bad.RedirectDNS, bad.CaptureAllDNS = true, true
	for _, kind := range []backend.Kind{backend.IptablesNft, backend.IptablesLegacy} {
		b, err := New(kind)
		if err != nil {
			t.Fatal(err)
		}
		for _, preloaded := range []bool{false, true} {
			name := string(kind) + "/empty"
			if preloaded {
				name = string(kind) + "/preloaded"
			}
			t.Run(name, func(t *testing.T) {
				ctx := context.Background()
				ns := testutil.NewNetns(t)
				if preloaded {
					if err := b.Apply(ctx, ns, rules.Build(&good)); err != nil {
						t.Fatal(err)
					}
					if _, err := b.run(ctx, ns, rules.V4, "-restore", "*nat\n-A OUTPUT -d 192.0.2.1/32 -j ACCEPT\nCOMMIT\n", "--noflush"); err != nil {
						t.Fatal(err)
					}
				}
				before := fullSave(t, b, ns)
				rs := rules.Build(&bad)
				// Fault: a TPROXY rule in the IPv6 raw table, which the kernel rejects
				// when that table is committed, after IPv4 (and, for legacy, the IPv6
				// mangle and nat tables) went in.
				injectFault(rs)
				err := b.Apply(ctx, ns, rs)
				if err == nil {
					t.Fatal("apply with a faulty rule succeeded")
				}
				if after := fullSave(t, b, ns); after != before {
					t.Fatalf("namespace changed by a failed apply:\n--- before\n%s--- after\n%s", before, after)
				}
				if !strings.Contains(err.Error(), "restore") {
					t.Errorf("error should say which restore failed: %v", err)
				}
			})
		}
	}
}

// injectFault makes the IPv6-only raw rule invalid: TPROXY is only valid in mangle.
func injectFault(rs *rules.Ruleset) {
	t := rs.Table(rules.TableRaw)
	t.Ops = append(t.Ops, rules.Op{Chain: rules.ChainOutputDNS, Rule: rules.Rule{
		Family:  rules.V6,
		Match:   rules.Match{Proto: rules.TCP, Dst: rules.PrefixMatch{Prefix: netip.MustParsePrefix("2001:db8::/32")}},
		Verdict: rules.Verdict{Kind: rules.TProxy, Port: 1, Mark: 1},
	}})
}
