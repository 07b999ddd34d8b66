# syntax=docker/dockerfile:1
# The meshcni image for those who build with Docker (BuildKit):
#
#   docker buildx build --platform linux/amd64,linux/arm64 \
#     --build-arg VERSION=v0.1.0 --build-arg REVISION=$(git rev-parse HEAD) -t REGISTRY/meshcni:v0.1.0 .
#
# It is the image `make images` builds without Docker (internal/build/image; docs/demo.md), and
# internal/build/image' TestDockerfileMatchesBuilder keeps the two in step: every cmd/* static
# (CGO_ENABLED=0, -trimpath, -s -w, -X main.version) in /usr/local/bin, the CNI plugin in
# /opt/meshcni/bin/meshcni (meshcni-agent's default --plugin-binary) with its API helper
# meshcni-podget beside it, /tmp 1777, on
# scratch, entrypoint meshcnictl (the image stands in for Istio's proxy-init image; the
# chart names the agent's command), no USER (the agent writes the node's CNI
# directories as root; the other commands run as any UID the pod sets). Not run in CI.
ARG GO_VERSION=1.26.8

FROM --platform=$BUILDPLATFORM golang:${GO_VERSION}-bookworm AS build
ARG TARGETARCH
ARG TARGETVARIANT
ARG VERSION=dev
WORKDIR /src
COPY go.mod go.sum ./
RUN --mount=type=cache,target=/go/pkg/mod go mod download
COPY . .
RUN --mount=type=cache,target=/go/pkg/mod --mount=type=cache,target=/root/.cache/go-build \
    set -eu; \
    export CGO_ENABLED=0 GOOS=linux GOARCH="$TARGETARCH"; \
    if [ "$TARGETARCH" = arm ]; then export GOARM="${TARGETVARIANT#v}"; fi; \
    go build -trimpath -ldflags="-s -w -X main.version=$VERSION" -o /out/ ./cmd/...; \
    mkdir -p /rootfs/usr/local/bin /rootfs/opt/meshcni/bin /rootfs/tmp; \
    chmod 1777 /rootfs/tmp; \
    mv /out/meshcni /out/meshcni-podget /rootfs/opt/meshcni/bin/; \
    mv /out/* /rootfs/usr/local/bin/

FROM scratch
ARG VERSION=dev
ARG REVISION=unknown
LABEL org.opencontainers.image.title="meshcni" \
      org.opencontainers.image.description="meshcni: CNI plugin, node agent and tools for service-mesh sidecar traffic redirect" \
      org.opencontainers.image.source="https://github.com/meshcni/meshcni" \
      org.opencontainers.image.url="https://github.com/meshcni/meshcni" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}"
COPY --from=build /rootfs/ /
ENV PATH=/usr/local/bin:/opt/meshcni/bin
ENTRYPOINT ["/usr/local/bin/meshcnictl"]
