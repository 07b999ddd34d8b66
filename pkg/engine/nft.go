package engine

import (
	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/backend/nftables"
)

func newNftables() (backend.Backend, error) { return nftables.New(), nil }
