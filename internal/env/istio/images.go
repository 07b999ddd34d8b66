package istio

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/meshcni/meshcni/internal/testkit/reporoot"
	"github.com/meshcni/meshcni/internal/tools/build/cachedir"
	"github.com/meshcni/meshcni/internal/tools/build/ociimage"
)

// Image names: Istio's injection template writes <global.hub>/proxyv2:<global.tag>
// and the istiod chart <hub>/pilot:<tag>.
const (
	Hub = "meshcni.local/istio"
	Tag = "dev"
	// AppImage is the test app: /echo (the test bed's echo server, its entrypoint)
	// and /proxysim (meshcni-proxysim, for `/proxysim client` probes from the app
	// container).
	AppImage = Hub + "/app:" + Tag
	// ProxyUID is the UID Istio runs pilot-agent and Envoy as; istiod's image runs
	// as it too (the chart sets runAsNonRoot).
	ProxyUID = 1337
)

// PilotImage and ProxyImage are istiod's image and the proxyv2 stand-in.
var (
	PilotImage = Hub + "/pilot:" + Tag
	ProxyImage = Hub + "/proxyv2:" + Tag
)

// Paths inside the proxyv2 image, as Istio's own image has them.
const (
	AgentPath         = "/usr/local/bin/pilot-agent"
	EnvoyPath         = "/usr/local/bin/envoy"
	BootstrapTmplPath = "/var/lib/istio/envoy/envoy_bootstrap_tmpl.json"
)

// stand-ins built from meshcni's module for the images.
var standIns = map[string]string{
	"envoy":    "./hack/envoy",
	"proxysim": "./hack/proxysim",
	"echo":     "./internal/env/testbed/cmd/testbed-echo",
}

// Images builds (or finds cached) the archive holding PilotImage, ProxyImage,
// AppImage and InstallCNIImage for build b and returns its path. The stand-ins are
// built into the repository's bin/istio-standins (go build relinks only what changed);
// the archive is cached by their content and the Istio build.
func Images(ctx context.Context, log *slog.Logger, b Build) (string, error) {
	if log == nil {
		log = slog.Default()
	}
	root, err := reporoot.Find()
	if err != nil {
		return "", fmt.Errorf("istio images: %w", err)
	}
	start := time.Now()
	work := filepath.Join(root, "bin", "istio-standins")
	if err := os.MkdirAll(work, 0o755); err != nil {
		return "", err
	}
	parts := [][]byte{[]byte(b.Dir), []byte(PilotImage + ProxyImage + AppImage + InstallCNIImage)}
	ipt, err := IptablesFiles()
	if err != nil {
		return "", fmt.Errorf("istio images: %w", err)
	}
	for _, dst := range slices.Sorted(maps.Keys(ipt)) {
		sum, err := fileSum(ipt[dst])
		if err != nil {
			return "", fmt.Errorf("istio images: %w", err)
		}
		parts = append(parts, []byte(dst), []byte(sum))
	}
	bins := map[string]string{}
	for _, name := range slices.Sorted(maps.Keys(standIns)) {
		pkg := standIns[name]
		out := filepath.Join(work, name)
		if err := ociimage.GoBinary(ctx, root, pkg, out); err != nil {
			return "", fmt.Errorf("istio images: %w", err)
		}
		sum, err := fileSum(out)
		if err != nil {
			return "", err
		}
		bins[name] = out
		parts = append(parts, []byte(name), []byte(sum))
	}
	dir := filepath.Join(CacheRoot(), "images-"+cachedir.Hash(parts...))
	archive := filepath.Join(dir, "images.tar")
	if _, err := os.Stat(filepath.Join(dir, cachedir.Marker)); err == nil {
		log.Info("istio images cached", "archive", archive, "took", time.Since(start).Round(time.Millisecond))
		return archive, nil
	}
	err = cachedir.Publish(dir, func(tmp string) error {
		return ociimage.BuildArchive(ctx, filepath.Join(tmp, "images.tar"), imageOptions(b, bins, ipt)...)
	})
	if err != nil {
		return "", fmt.Errorf("istio images: %w", err)
	}
	log.Info("istio images built", "archive", archive, "took", time.Since(start).Round(time.Millisecond))
	return archive, nil
}

// imageOptions describes the four images; ipt is the host's iptables for the
// proxyv2 image (IptablesFiles).
func imageOptions(b Build, bins, ipt map[string]string) []ociimage.Options {
	uid := fmt.Sprintf("%d:%d", ProxyUID, ProxyUID)
	tmp := map[string]os.FileMode{"/tmp": os.ModeSticky | 0o777}
	return []ociimage.Options{
		{
			Ref:        PilotImage,
			Files:      map[string]string{"/usr/local/bin/pilot-discovery": b.Bin("pilot-discovery")},
			Dirs:       tmp,
			Entrypoint: []string{"/usr/local/bin/pilot-discovery"},
			User:       uid,
		},
		proxyImage(b, bins, ipt),
		installCNIImage(b, ipt),
		{
			Ref:        AppImage,
			Files:      map[string]string{"/echo": bins["echo"], "/proxysim": bins["proxysim"]},
			Dirs:       tmp,
			Entrypoint: []string{"/echo"},
		},
	}
}

// proxyImage is the proxyv2 stand-in: Istio's pilot-agent, the Envoy stand-in,
// Istio's bootstrap template, and the host's iptables (for istio-init, run by the
// injector without pilot.cni.enabled), with the xtables lock directory /run.
func proxyImage(b Build, bins, ipt map[string]string) ociimage.Options {
	files := map[string]string{
		AgentPath:         b.Bin("pilot-agent"),
		EnvoyPath:         bins["envoy"],
		BootstrapTmplPath: b.Bootstrap(),
	}
	maps.Copy(files, ipt)
	return ociimage.Options{
		Ref:   ProxyImage,
		Files: files,
		Dirs: map[string]os.FileMode{
			"/tmp": os.ModeSticky | 0o777, "/etc/istio/proxy": 0o777, "/var/lib/istio/data": 0o777, "/run": 0o755,
		},
		Env:        []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
		Entrypoint: []string{AgentPath},
	}
}

func fileSum(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}
