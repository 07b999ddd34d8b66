package istio

import "testing"

func TestMergeValues(t *testing.T) {
	got := mergeValues(Values(), map[string]any{"pilot": map[string]any{"taint": map[string]any{"enabled": true, "namespace": "meshcni-system"}}, "autoscaleEnabled": true})
	pilot := got["pilot"].(map[string]any)
	if pilot["cni"].(map[string]any)["enabled"] != true || pilot["taint"].(map[string]any)["namespace"] != "meshcni-system" || got["autoscaleEnabled"] != true {
		t.Fatalf("merged values %v", got)
	}
}
