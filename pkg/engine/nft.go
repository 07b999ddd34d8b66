package engine

import (
	"fmt"

	"github.com/meshcni/meshcni/pkg/backend"
)

func newNftables() (backend.Backend, error) {
	return nil, fmt.Errorf("the native nftables backend is not built in yet")
}
