// Package migration holds the end-to-end tests of the switch between Istio's own
// istio-cni and meshcni, both ways, on the test bed: Istio installed without meshcni
// (istio.Up with SkipMeshcni), Istio's istio-cni chart, and the procedures of
// docs/migration.md run as written (istio.RunDocBlock). Its own package because the
// shared install of internal/env/istio/e2e always has meshcni in the chain.
package migration
