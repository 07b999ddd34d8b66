package buildmetrics

import (
	"runtime"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/meshcni/meshcni/pkg/buildinfo"
)

func TestCollector(t *testing.T) {
	want := `# HELP meshcni_build_info 1, labelled with the version of the running binary and the Go release it was built with.
# TYPE meshcni_build_info gauge
meshcni_build_info{goversion="` + runtime.Version() + `",version="1.2.3"} 1
`
	if err := testutil.CollectAndCompare(Collector(buildinfo.New("1.2.3")), strings.NewReader(want)); err != nil {
		t.Error(err)
	}
}
