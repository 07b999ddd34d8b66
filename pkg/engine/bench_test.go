package engine_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/meshcni/meshcni/internal/testutil"
	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/engine"
	"github.com/meshcni/meshcni/pkg/spec"
)

// BenchmarkApply measures engine.Apply of the default sidecar ruleset (IPv4+IPv6)
// into a fresh network namespace per iteration, per backend; namespace creation
// is outside the timed region.
func BenchmarkApply(b *testing.B) {
	testutil.RequireRoot(b)
	s := spec.PodDefaults()
	s.EnableIPv6 = true
	kinds := []backend.Kind{backend.IptablesLegacy, backend.IptablesNft}
	if _, err := engine.New(backend.Nftables); err == nil {
		kinds = append(kinds, backend.Nftables)
	}
	for _, k := range kinds {
		b.Run(string(k), func(b *testing.B) {
			for i := 0; b.Loop(); i++ {
				b.StopTimer()
				path, err := testutil.CreateNetns(fmt.Sprintf("mcni-bench-%d", i))
				if err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
				if _, err := engine.Apply(context.Background(), engine.Options{Backend: k, NetnsPath: path}, &s); err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				if err := testutil.DeleteNetns(path); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
		})
	}
}
