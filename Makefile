# meshcni — see README.md. `make test` is what CI runs (as root).
SHELL := /bin/bash
GO ?= go
CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/meshcni
STATICCHECK_VERSION := v0.8.2
STATICCHECK := $(CACHE)/tools/staticcheck-$(STATICCHECK_VERSION)/staticcheck
BIN := bin

.PHONY: all build test lint unit bench demo demo-down clean

all: build

build:
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags='-s -w' -o $(BIN)/ ./cmd/...

$(STATICCHECK):
	GOBIN=$(dir $@) $(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)

lint: $(STATICCHECK)
	@unformatted=$$(gofmt -l $$(git ls-files '*.go')); \
	if [ -n "$$unformatted" ]; then echo "gofmt needed:"; echo "$$unformatted"; exit 1; fi
	$(GO) vet ./...
	$(STATICCHECK) ./...

# Unit and integration tests. Most need root (network namespaces, rules). -p 1: several
# packages start the real single-node test bed, which is one per machine.
unit:
	$(GO) test -count=1 -p 1 -timeout 40m ./...

test: lint unit

bench:
	$(GO) test -run '^$$' -bench . -benchmem ./pkg/...

demo: build
	$(GO) run ./hack/demo

clean:
	rm -rf $(BIN)

# --- Helm chart (deploy/, docs/install.md) ---
.PHONY: helm chart-lint manifests
# Helm built from the Go module proxy (not in go.mod), cached under $(CACHE)/tools/helm-<version>.
helm:
	@bash hack/helm --path
chart-lint: helm
	"$$(bash hack/helm --path)" lint --strict deploy/charts/meshcni
# Re-render deploy/manifests from the chart (TestManifests fails when they are stale).
manifests: helm
	$(GO) test -count=1 ./deploy -run '^TestManifests$$' -update
