package istio

import (
	"encoding/json"
	"testing"
)

func TestWithCNI(t *testing.T) {
	for _, c := range []struct {
		values string
		cni    bool
	}{
		{`{"global":{"hub":"h"},"pilot":{"cni":{"enabled":true,"provider":"default"},"env":{}}}`, false},
		{`{"global":{"hub":"h"},"pilot":{"cni":{"enabled":false}}}`, true},
		{`{"global":{"hub":"h"}}`, false},
	} {
		out, err := withCNI(c.values, c.cni)
		if err != nil {
			t.Fatalf("%s: %v", c.values, err)
		}
		var v struct {
			Global struct{ Hub string }
			Pilot  struct {
				CNI map[string]any
			}
		}
		if err := json.Unmarshal([]byte(out), &v); err != nil {
			t.Fatal(err)
		}
		if v.Pilot.CNI["enabled"] != c.cni || v.Global.Hub != "h" {
			t.Errorf("withCNI(%s, %v) = %s", c.values, c.cni, out)
		}
	}
	if _, err := withCNI("{", true); err == nil {
		t.Error("withCNI of broken JSON: no error")
	}
}
