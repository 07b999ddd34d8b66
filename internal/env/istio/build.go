// Package istio runs the real Istio on the test bed: istiod (pilot-discovery) with
// its sidecar injector, and pilot-agent in every injected pod, both built from the
// Go module proxy at the one version pinned in hack/istio-build/go.mod, installed
// with Istio's own Helm charts taken from the same module, next to meshcni installed
// with its own chart.
//
// Build compiles pilot-discovery, pilot-agent, istioctl, istio-cni and install-cni
// (Istio's CNI plugin and its installer) and copies the charts and
// the Envoy bootstrap template into a cache directory keyed by the Istio version, the
// Go toolchain and the wrapper module's go.mod/go.sum (published atomically, like the
// test bed's Kubernetes). Images builds the images the test bed imports: istiod's,
// the proxyv2 stand-in (the real pilot-agent plus the Envoy stand-in of
// internal/standin/proxysim) and a small app image. Up and Down install and remove Istio
// and meshcni on a running test bed.
package istio

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/meshcni/meshcni/internal/testkit/reporoot"
	"github.com/meshcni/meshcni/internal/tools/build/cachedir"
)

// Module is the Go module Istio is built from.
const Module = "istio.io/istio"

// WrapperDir is the wrapper module (relative to the repository root) whose go.mod
// pins the Istio version: the only place it is written.
const WrapperDir = "hack/istio-build"

// buildRecipe: bump when the way binaries are built changes, to invalidate caches.
const buildRecipe = "istio-v1 CGO_ENABLED=0 -trimpath -ldflags=-s -w -X version"

// Commands are the Istio commands built, by package.
var Commands = map[string]string{
	"pilot-discovery": Module + "/pilot/cmd/pilot-discovery",
	"pilot-agent":     Module + "/pilot/cmd/pilot-agent",
	"istioctl":        Module + "/istioctl/cmd/istioctl",
	"istio-cni":       Module + "/cni/cmd/istio-cni",
	"install-cni":     Module + "/cni/cmd/install-cni",
}

// Charts are the Helm charts copied from the module: name in the cache → path in
// the module.
var Charts = map[string]string{
	"base":            "manifests/charts/base",
	"istio-discovery": "manifests/charts/istio-control/istio-discovery",
	"istio-cni":       "manifests/charts/istio-cni",
}

// BootstrapTemplate is Istio's Envoy bootstrap template in the module; proxyv2
// images carry it at /var/lib/istio/envoy/envoy_bootstrap_tmpl.json.
const BootstrapTemplate = "tools/packaging/common/envoy_bootstrap.json"

// Build is a cached Istio build.
type Build struct {
	// Version is the module version (a pseudo-version), Release the module's VERSION
	// file plus "-dev" as Istio's own build stamps it, Revision the commit.
	Version, Release, Revision string
	// Dir holds bin/<command> (the keys of Commands), charts/<name>,
	// envoy_bootstrap.json and build.json.
	Dir string
}

// Bin is the path of a built command.
func (b Build) Bin(cmd string) string { return filepath.Join(b.Dir, "bin", cmd) }

// Chart is the path of a chart copied from the module (a key of Charts).
func (b Build) Chart(name string) string { return filepath.Join(b.Dir, "charts", name) }

// Bootstrap is the path of the Envoy bootstrap template.
func (b Build) Bootstrap() string { return filepath.Join(b.Dir, "envoy_bootstrap.json") }

// CacheRoot is ${XDG_CACHE_HOME:-$HOME/.cache}/meshcni/istio.
func CacheRoot() string { return cachedir.Root("istio") }

// PinnedVersion reads the Istio version required by the wrapper module's go.mod.
func PinnedVersion(root string) (string, error) {
	gomod := filepath.Join(root, WrapperDir, "go.mod")
	f, err := os.Open(gomod)
	if err != nil {
		return "", fmt.Errorf("istio version: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(strings.TrimPrefix(strings.TrimSpace(sc.Text()), "require "))
		if len(fields) >= 2 && fields[0] == Module {
			return fields[1], nil
		}
	}
	return "", fmt.Errorf("istio version: %s requires no %s", gomod, Module)
}

// revision is the commit of a pseudo-version (its last dash-separated part).
func revision(version string) string {
	i := strings.LastIndex(version, "-")
	if i < 0 {
		return version
	}
	return version[i+1:]
}

func goEnv(ctx context.Context, key string) (string, error) {
	out, err := exec.CommandContext(ctx, "go", "env", key).Output()
	if err != nil {
		return "", fmt.Errorf("go env %s: %w", key, err)
	}
	return strings.TrimSpace(string(out)), nil
}

// cacheDir computes the cache directory of the build for the repository at root.
func cacheDir(ctx context.Context, root string) (version, dir string, err error) {
	if version, err = PinnedVersion(root); err != nil {
		return "", "", err
	}
	gov, err := goEnv(ctx, "GOVERSION")
	if err != nil {
		return "", "", err
	}
	parts := [][]byte{[]byte(version), []byte(gov), []byte(buildRecipe)}
	for _, name := range slices.Sorted(maps.Keys(Commands)) {
		parts = append(parts, []byte(name), []byte(Commands[name]))
	}
	for _, f := range []string{"go.mod", "go.sum"} {
		b, err := os.ReadFile(filepath.Join(root, WrapperDir, f))
		if err != nil {
			return "", "", fmt.Errorf("istio cache key: %w", err)
		}
		parts = append(parts, b)
	}
	return version, filepath.Join(CacheRoot(), "istio-"+revision(version)+"-"+cachedir.Hash(parts...)), nil
}

// ErrNotBuilt is returned by Lookup when Istio is not in the cache.
var ErrNotBuilt = errors.New("istio is not built: run hack/istio build")

// Lookup finds the cached build for the repository containing the working directory.
func Lookup(ctx context.Context) (Build, error) {
	root, err := reporoot.Find()
	if err != nil {
		return Build{}, fmt.Errorf("istio: %w", err)
	}
	version, dir, err := cacheDir(ctx, root)
	if err != nil {
		return Build{}, err
	}
	b := Build{Version: version, Revision: revision(version), Dir: dir}
	if _, err := os.Stat(filepath.Join(dir, cachedir.Marker)); err != nil {
		return b, fmt.Errorf("%w (no %s)", ErrNotBuilt, dir)
	}
	return b, b.readInfo()
}

// buildInfo is build.json.
type buildInfo struct {
	Version, Release, Revision, GoVersion string
	Took                                  string
}

func (b *Build) readInfo() error {
	raw, err := os.ReadFile(filepath.Join(b.Dir, "build.json"))
	if err != nil {
		return fmt.Errorf("istio build info: %w", err)
	}
	var bi buildInfo
	if err := json.Unmarshal(raw, &bi); err != nil {
		return fmt.Errorf("istio build info %s: %w", b.Dir, err)
	}
	b.Release = bi.Release
	return nil
}

// EnsureBuilt builds Istio unless the cache has it (cold: minutes on 2 cores; warm:
// immediate) and returns the build. Concurrent builds are safe: the first to finish
// publishes, the others keep it.
func EnsureBuilt(ctx context.Context, log *slog.Logger) (Build, error) {
	if log == nil {
		log = slog.Default()
	}
	root, err := reporoot.Find()
	if err != nil {
		return Build{}, fmt.Errorf("istio: %w", err)
	}
	version, dir, err := cacheDir(ctx, root)
	if err != nil {
		return Build{}, err
	}
	b := Build{Version: version, Revision: revision(version), Dir: dir}
	if _, err := os.Stat(filepath.Join(dir, cachedir.Marker)); err == nil {
		log.Info("istio cached", "version", version, "dir", dir)
		return b, b.readInfo()
	}
	start := time.Now()
	log.Info("building istio (pilot-discovery, pilot-agent, istioctl, istio-cni, install-cni)", "version", version, "dir", dir)
	err = cachedir.Publish(dir, func(tmp string) error { return fill(ctx, root, version, tmp, start) })
	if err != nil {
		return b, fmt.Errorf("build istio %s: %w", version, err)
	}
	log.Info("istio built", "version", version, "took", time.Since(start).Round(time.Second))
	return b, b.readInfo()
}

// fill builds the commands into tmp/bin and copies the charts and bootstrap.
func fill(ctx context.Context, root, version, tmp string, start time.Time) error {
	wrapper := filepath.Join(root, WrapperDir)
	modDir, err := moduleDir(ctx, wrapper)
	if err != nil {
		return err
	}
	relb, err := os.ReadFile(filepath.Join(modDir, "VERSION"))
	if err != nil {
		return fmt.Errorf("istio VERSION file: %w", err)
	}
	release := strings.TrimSpace(string(relb)) + "-dev"
	const v = "istio.io/istio/pkg/version."
	ldflags := "-s -w -X " + v + "buildVersion=" + release + " -X " + v + "buildGitRevision=" + revision(version) +
		" -X " + v + "buildStatus=Clean -X " + v + "buildTag=" + version + " -X " + v + "buildHub=" + Hub
	args := []string{"build", "-trimpath", "-ldflags=" + ldflags, "-o", filepath.Join(tmp, "bin") + "/"}
	for _, pkg := range Commands {
		args = append(args, pkg)
	}
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = wrapper
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("go build: %w", err)
	}
	for name, rel := range Charts {
		if err := copyTree(filepath.Join(modDir, rel), filepath.Join(tmp, "charts", name)); err != nil {
			return err
		}
	}
	if err := copyFile(filepath.Join(modDir, BootstrapTemplate), filepath.Join(tmp, "envoy_bootstrap.json"), 0o644); err != nil {
		return err
	}
	gov, _ := goEnv(ctx, "GOVERSION")
	info, _ := json.MarshalIndent(buildInfo{Version: version, Release: release, Revision: revision(version),
		GoVersion: gov, Took: time.Since(start).Round(time.Second).String()}, "", "  ")
	return os.WriteFile(filepath.Join(tmp, "build.json"), append(info, '\n'), 0o644)
}

// ModuleDir returns the pinned Istio module's directory in the Go module cache
// (downloading it when missing): its manifests/ are what istioctl renders from.
func ModuleDir(ctx context.Context) (string, error) {
	root, err := reporoot.Find()
	if err != nil {
		return "", fmt.Errorf("istio: %w", err)
	}
	return moduleDir(ctx, filepath.Join(root, WrapperDir))
}

// moduleDir downloads the Istio module (as the wrapper's go.sum pins it) and
// returns its directory in the module cache.
func moduleDir(ctx context.Context, wrapper string) (string, error) {
	cmd := exec.CommandContext(ctx, "go", "mod", "download", "-json", Module)
	cmd.Dir = wrapper
	out, err := cmd.Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return "", fmt.Errorf("go mod download %s: %w: %s", Module, err, strings.TrimSpace(string(ee.Stderr)))
		}
		return "", fmt.Errorf("go mod download %s: %w", Module, err)
	}
	var m struct{ Dir, Error string }
	if err := json.Unmarshal(out, &m); err != nil {
		return "", fmt.Errorf("go mod download %s: %w", Module, err)
	}
	if m.Error != "" || m.Dir == "" {
		return "", fmt.Errorf("go mod download %s: %s", Module, m.Error)
	}
	return m.Dir, nil
}

// copyTree copies a directory of regular files (module cache files are read-only;
// the copies are writable).
func copyTree(src, dst string) error {
	err := filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(src, p)
		if err != nil {
			return err
		}
		target := filepath.Join(dst, rel)
		if d.IsDir() {
			return os.MkdirAll(target, 0o755)
		}
		if !d.Type().IsRegular() {
			return fmt.Errorf("%s is not a regular file", p)
		}
		return copyFile(p, target, 0o644)
	})
	if err != nil {
		return fmt.Errorf("copy %s: %w", src, err)
	}
	return nil
}

func copyFile(src, dst string, mode os.FileMode) error {
	b, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	return os.WriteFile(dst, b, mode)
}
