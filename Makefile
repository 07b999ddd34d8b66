# meshcni — see README.md. `make test` is what CI runs (as root).
SHELL := /bin/bash
GO ?= go
CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/meshcni
STATICCHECK_VERSION := v0.8.2
STATICCHECK := $(CACHE)/tools/staticcheck-$(STATICCHECK_VERSION)/staticcheck
BIN := bin

.PHONY: all build test lint unit e2e bench bench-smoke demo demo-down clean

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

# What CI runs (docs/testing.md, "What make test runs").
test: lint unit e2e bench-smoke fuzz-smoke

# Unit tests: everything that needs neither root, nor a program on PATH, nor the test
# bed (those skip under -short, also with CI=true), packages in parallel, race detector on.
unit:
	$(GO) test -short -race -count=1 -timeout 10m ./...

# The packages whose tests use the one-per-machine test bed (their test binary links
# internal/env/testbed), and the others, which need at most root and network namespaces.
MODULE := github.com/meshcni/meshcni
TESTBED_PKGS = $(MODULE)/internal/env/testbed $(shell $(GO) list -test -f '{{.ImportPath}}{{range .Deps}}{{if eq . "$(MODULE)/internal/env/testbed"}} testbed{{end}}{{end}}' ./... | awk '$$1 ~ /\.test$$/ && $$2 == "testbed" {sub(/\.test$$/, "", $$1); print $$1}')
OTHER_PKGS = $(filter-out $(TESTBED_PKGS),$(shell $(GO) list ./...))

# streams runs the command $(call $(1),PACKAGES) for the test-bed packages and, at the
# same time, for the others (their output follows, in one block); it fails when either fails.
define streams
	@other=$$(mktemp); \
	{ $(call $(1),$(OTHER_PKGS)); } >"$$other" 2>&1 & pid=$$!; \
	{ $(call $(1),$(TESTBED_PKGS)); }; rc=$$?; \
	wait $$pid; rc2=$$?; \
	echo "--- packages without the test bed:"; cat "$$other"; rm -f "$$other"; \
	test $$rc -eq 0 && test $$rc2 -eq 0
endef

# The packages whose root and test-bed tests e2e runs with the race detector instead of
# without: the agent and what runs in it (audit, repair, the plugin's socket, eBPF), where
# goroutines meet real network namespaces, sockets and API watches (docs/testing.md, "The
# race detector").
RACE_PKGS = $(addprefix $(MODULE)/,pkg/agent pkg/agentsock pkg/audit pkg/repair pkg/ebpf/sockmap)
# Tests of RACE_PKGS that run without the race detector all the same, and the packages
# holding them: pkg/audit's TestThousandRounds (1000 rounds over 110 namespaces, a
# resource soak) takes over 20 min under -race, against minutes without.
RACE_SKIP = ^TestThousandRounds$$
RACE_SKIP_PKGS = $(MODULE)/pkg/audit

# gotest_race runs `go test $(1)` over the packages $(2): those not in RACE_PKGS, then
# those in it with -race (but RACE_SKIP, run without it after); it fails when any of
# them fails, and when $(2) is empty.
gotest_race = rc=0; \
	$(if $(strip $(2)),,echo "no packages to test" >&2; rc=1;) \
	$(if $(filter-out $(RACE_PKGS),$(2)),$(GO) test $(1) $(filter-out $(RACE_PKGS),$(2)) || rc=1;) \
	$(if $(filter $(RACE_PKGS),$(2)),$(GO) test -race $(1) -skip '$(RACE_SKIP)' $(filter $(RACE_PKGS),$(2)) || rc=1;) \
	$(if $(filter $(RACE_SKIP_PKGS),$(2)),$(GO) test $(1) -run '$(RACE_SKIP)' $(filter $(RACE_SKIP_PKGS),$(2)) || rc=1;) \
	test $$rc -eq 0

# End-to-end and root tests: real network namespaces, rules, the test bed. -p 1 within a
# stream: the test-bed packages share the one test bed, one after another, while the
# others run beside them. Runs the unit tests again, once: RACE_PKGS with -race, the
# others without.
e2e_go = $(call gotest_race,-count=1 -p 1 -timeout 40m,$(1))
e2e:
	$(call streams,e2e_go)

# Every benchmark once, so benchmark code cannot rot. Root benchmarks run as root.
bench_go = $(GO) test -count=1 -p 1 -run '^$$' -bench . -benchtime 1x -timeout 20m $(1)
bench-smoke:
	$(call streams,bench_go)

# Benchmarks for figures (docs/performance.md).
bench:
	$(GO) test -run '^$$' -bench . -benchmem ./pkg/...

# --- Image and demo (docs/demo.md) ---
.PHONY: images demo-netns
HUB ?= meshcni.local
TAG ?= dev
ARCH ?=
# The meshcni image without Docker (internal/tools/build/image): $(BIN)/images/meshcni-$(TAG).tar, an OCI
# layout tarball for `ctr images import` / `docker load`. ARCH=amd64,arm64: an index of both.
images:
	$(GO) run ./hack/images --hub $(HUB) --tag $(TAG) $(if $(ARCH),--arch $(ARCH)) --out $(BIN)/images/meshcni-$(TAG).tar
# The README's main command (root): packages, image, test bed, Helm install, demo app, report.
# Everything stays up afterwards; demo-down removes it (helm uninstall, test bed down).
demo:
	bash hack/deps
	$(GO) run ./hack/demo up --hub $(HUB) --tag $(TAG) $(if $(ISTIO),--istio)
demo-down:
	$(GO) run ./hack/demo down
# The first demo: meshcni's rules in a bare network namespace, no Kubernetes.
demo-netns: build
	$(GO) run ./hack/demo-netns

clean:
	rm -rf $(BIN)

# --- Release (docs/release.md) ---
.PHONY: release
RELEASE_HUB ?= ghcr.io/meshcni
RELEASE_ARCH ?= amd64,arm64
# dist/$(VERSION)/: the multi-arch image (OCI layout archive), IMAGE (reference@digest), the
# packaged chart (its default image is the one built), plain manifests, SHA256SUMS.
release: helm
	@test -n "$(VERSION)" || { echo "usage: make release VERSION=x.y.z [RELEASE_HUB=$(RELEASE_HUB)]" >&2; exit 2; }
	$(GO) run ./hack/release --version $(VERSION) --hub $(RELEASE_HUB) --arch $(RELEASE_ARCH)

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

# --- Generated configuration reference (internal/tools/refdoc; its test fails when stale) ---
.PHONY: reference
reference:
	$(GO) test -count=1 ./internal/tools/refdoc -run '^TestReferenceUpToDate$$' -update

# --- Fuzzing (docs/security.md "Fuzzing") ---
# Each target of FUZZ_TARGETS (package:FuzzName) runs alone (-fuzz takes one target).
# `make fuzz` runs each for FUZZTIME executions; fuzz-smoke runs each briefly. The
# seed corpora (f.Add and testdata/fuzz/) also run as plain tests in `go test`.
.PHONY: fuzz fuzz-smoke
FUZZ_TARGETS := \
	./pkg/capture:FuzzSpec \
	./pkg/spec:FuzzParsePorts ./pkg/spec:FuzzParsePrefixes ./pkg/spec:FuzzParseNames ./pkg/spec:FuzzParseModeBool \
	./pkg/plugin:FuzzParseConfig ./pkg/plugin:FuzzCNIArgs \
	./pkg/cniconf:FuzzInjectRemove \
	./pkg/podget/helper:FuzzParseKubeconfig \
	./pkg/agentsock:FuzzServeConn \
	./pkg/netlink:FuzzNetlinkWalk \
	./pkg/backend/iptables:FuzzParseSave ./pkg/backend/iptables:FuzzOwnedRule
FUZZTIME ?= 1000000x
FUZZPARALLEL ?= 1
fuzz:
	@set -e; for t in $(FUZZ_TARGETS); do \
		echo "== $${t#*:} ($${t%%:*}), $(FUZZTIME)"; \
		$(GO) test -run '^$$' -fuzz "^$${t#*:}\$$" -fuzztime $(FUZZTIME) -parallel $(FUZZPARALLEL) $${t%%:*}; \
	done
fuzz-smoke:
	@$(MAKE) --no-print-directory fuzz FUZZTIME=2000x
