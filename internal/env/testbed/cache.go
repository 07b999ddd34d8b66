package testbed

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/meshcni/meshcni/internal/testkit/reporoot"
	"github.com/meshcni/meshcni/internal/tools/build/cachedir"
	"github.com/meshcni/meshcni/internal/tools/build/ociimage"
)

// KubernetesVersion is the version of k8s.io/kubernetes the test bed builds (pinned
// in hack/k8s-build/go.mod).
const KubernetesVersion = "v1.35.4"

// Recipes: bump when the way binaries are built changes, to invalidate caches.
const (
	k8sRecipe = "k8s-v1 -trimpath " + k8sLdflags
	auxRecipe = "aux-v2 CGO_ENABLED=0 -trimpath -ldflags=-s -w go install @" + CNIPluginsVersion
	// k8sLdflags strip the binaries and stamp the version the way Kubernetes'
	// own build does (kubelet reports it; the API server derives its emulation
	// version from it).
	k8sLdflags = "-s -w" +
		" -X k8s.io/component-base/version.gitVersion=" + KubernetesVersion +
		" -X k8s.io/component-base/version.gitMajor=1" +
		" -X k8s.io/component-base/version.gitMinor=35" +
		" -X k8s.io/component-base/version.gitTreeState=clean" +
		" -X k8s.io/client-go/pkg/version.gitVersion=" + KubernetesVersion +
		" -X k8s.io/client-go/pkg/version.gitMajor=1" +
		" -X k8s.io/client-go/pkg/version.gitMinor=35"
)

// k8sCommands are built from k8s.io/kubernetes/cmd/<name>.
var k8sCommands = []string{"kube-apiserver", "kubelet", "kube-controller-manager", "kube-scheduler", "kubectl"}

// CNIPluginsVersion is the containernetworking/plugins release whose reference plugins
// the test bed runs. They are built with `go install pkg@version`, in their own
// module (its go.mod and go.sum), not in meshcni's: meshcni's go.sum need not (and,
// once tidied, does not) list their dependencies.
const CNIPluginsVersion = "v1.10.0"

// cniPlugins are the reference plugins installed into CNIBinDir.
var cniPlugins = map[string]string{
	"bridge":     "github.com/containernetworking/plugins/plugins/main/bridge",
	"loopback":   "github.com/containernetworking/plugins/plugins/main/loopback",
	"host-local": "github.com/containernetworking/plugins/plugins/ipam/host-local",
	"portmap":    "github.com/containernetworking/plugins/plugins/meta/portmap",
}

// Binaries are the cached build outputs a test bed runs.
type Binaries struct {
	// K8sDir holds kube-apiserver, kubelet, kube-controller-manager, kube-scheduler
	// and kubectl.
	K8sDir string
	// AuxDir holds cni/<plugin> (bridge, host-local, loopback, portmap) and
	// images.tar (the pause and echo images).
	AuxDir string
}

// Path of a Kubernetes command (e.g. "kubectl").
func (b Binaries) Path(cmd string) string { return filepath.Join(b.K8sDir, cmd) }

// CNIPluginDir is the directory holding the reference CNI plugins.
func (b Binaries) CNIPluginDir() string { return filepath.Join(b.AuxDir, "cni") }

// ImagesArchive is the docker archive with PauseImage and EchoImage.
func (b Binaries) ImagesArchive() string { return filepath.Join(b.AuxDir, "images.tar") }

// RepoRoot finds the meshcni module root, walking up from the working directory.
func RepoRoot() (string, error) {
	dir, err := reporoot.Find()
	if err != nil {
		return "", fmt.Errorf("testbed: %w", err)
	}
	return dir, nil
}

var (
	goVersionOnce sync.Once
	goVersion     string
	goVersionErr  error
)

// toolchainVersion is `go env GOVERSION` (the toolchain that builds, which may
// differ from the running binary's).
func toolchainVersion() (string, error) {
	goVersionOnce.Do(func() {
		out, err := exec.Command("go", "env", "GOVERSION").Output()
		if err != nil {
			goVersionErr = fmt.Errorf("go env GOVERSION: %w", err)
			return
		}
		goVersion = strings.TrimSpace(string(out))
	})
	return goVersion, goVersionErr
}

// cacheDirs computes the cache directories for the repository at root.
func cacheDirs(root string) (k8sDir, auxDir string, err error) {
	gov, err := toolchainVersion()
	if err != nil {
		return "", "", err
	}
	var k8sParts [][]byte
	k8sParts = append(k8sParts, []byte(KubernetesVersion), []byte(gov), []byte(k8sRecipe), []byte(strings.Join(k8sCommands, ",")))
	for _, f := range []string{"hack/k8s-build/go.mod", "hack/k8s-build/go.sum"} {
		b, err := os.ReadFile(filepath.Join(root, f))
		if err != nil {
			return "", "", fmt.Errorf("testbed cache key: %w", err)
		}
		k8sParts = append(k8sParts, b)
	}
	auxParts := [][]byte{[]byte(gov), []byte(auxRecipe), []byte(PauseImage), []byte(EchoImage)}
	for _, d := range []string{"internal/env/testbed/cmd/testbed-pause", "internal/env/testbed/cmd/testbed-echo"} {
		files, _ := filepath.Glob(filepath.Join(root, d, "*.go"))
		if len(files) == 0 {
			return "", "", fmt.Errorf("testbed cache key: no sources in %s", d)
		}
		for _, f := range files {
			b, err := os.ReadFile(f)
			if err != nil {
				return "", "", fmt.Errorf("testbed cache key: %w", err)
			}
			auxParts = append(auxParts, []byte(filepath.Base(f)), b)
		}
	}
	cr := CacheRoot()
	return filepath.Join(cr, "k8s-"+KubernetesVersion+"-"+cachedir.Hash(k8sParts...)),
		filepath.Join(cr, "aux-"+cachedir.Hash(auxParts...)), nil
}

// CacheRoot is ${XDG_CACHE_HOME:-$HOME/.cache}/meshcni/testbed.
func CacheRoot() string { return cachedir.Root("testbed") }

// ErrNotBuilt is returned by Lookup when the binaries are not in the cache.
var ErrNotBuilt = errors.New("test bed binaries are not built: run hack/testbed build")

// Lookup finds the cached binaries for the repository containing the working
// directory. It returns an error wrapping ErrNotBuilt when the Kubernetes binaries
// are missing; the auxiliary ones (CNI plugins, images) are cheap and Start builds
// them if needed, so Lookup reports them but does not fail on them.
func Lookup() (Binaries, error) {
	root, err := RepoRoot()
	if err != nil {
		return Binaries{}, err
	}
	k8sDir, auxDir, err := cacheDirs(root)
	if err != nil {
		return Binaries{}, err
	}
	b := Binaries{K8sDir: k8sDir, AuxDir: auxDir}
	if _, err := os.Stat(filepath.Join(k8sDir, cachedir.Marker)); err != nil {
		return b, fmt.Errorf("%w (no %s)", ErrNotBuilt, k8sDir)
	}
	return b, nil
}

func auxBuilt(b Binaries) bool {
	_, err := os.Stat(filepath.Join(b.AuxDir, cachedir.Marker))
	return err == nil
}

// Build builds whatever is missing from the cache (Kubernetes ≈ 13 min cold on 2
// cores, the rest seconds) and returns the binaries. It is idempotent and returns
// at once when everything is cached.
func Build(ctx context.Context, log *slog.Logger) (Binaries, error) {
	if log == nil {
		log = slog.Default()
	}
	root, err := RepoRoot()
	if err != nil {
		return Binaries{}, err
	}
	k8sDir, auxDir, err := cacheDirs(root)
	if err != nil {
		return Binaries{}, err
	}
	b := Binaries{K8sDir: k8sDir, AuxDir: auxDir}
	if _, err := os.Stat(filepath.Join(k8sDir, cachedir.Marker)); err != nil {
		if err := buildK8s(ctx, log, root, k8sDir); err != nil {
			return b, err
		}
	} else {
		log.Info("kubernetes binaries cached", "dir", k8sDir)
	}
	if err := ensureAux(ctx, log, root, b); err != nil {
		return b, err
	}
	return b, nil
}

func buildK8s(ctx context.Context, log *slog.Logger, root, dir string) error {
	start := time.Now()
	log.Info("building kubernetes (cold: 5–13 min on 2 cores; warm: ~30 s)", "version", KubernetesVersion, "dir", dir)
	err := cachedir.Publish(dir, func(tmp string) error {
		args := []string{"build", "-trimpath", "-ldflags=" + k8sLdflags, "-o", tmp + "/"}
		for _, c := range k8sCommands {
			args = append(args, "k8s.io/kubernetes/cmd/"+c)
		}
		cmd := exec.CommandContext(ctx, "go", args...)
		cmd.Dir = filepath.Join(root, "hack", "k8s-build")
		cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("build kubernetes: %w", err)
		}
		return nil
	})
	if err != nil {
		return err
	}
	log.Info("kubernetes built", "took", time.Since(start).Round(time.Second))
	return nil
}

func ensureAux(ctx context.Context, log *slog.Logger, root string, b Binaries) error {
	if auxBuilt(b) {
		return nil
	}
	start := time.Now()
	err := cachedir.Publish(b.AuxDir, func(tmp string) error {
		cni := filepath.Join(tmp, "cni")
		args := []string{"install", "-trimpath", "-ldflags=-s -w"}
		for _, p := range cniPlugins {
			args = append(args, p+"@"+CNIPluginsVersion)
		}
		cmd := exec.CommandContext(ctx, "go", args...)
		cmd.Dir = tmp // outside any module: pkg@version uses the plugins' own go.mod
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOBIN="+cni, "GOFLAGS=")
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("build CNI plugins: %w: %s", err, out)
		}
		pause, echo := filepath.Join(tmp, "pause"), filepath.Join(tmp, "echo")
		if err := ociimage.GoBinary(ctx, root, "./internal/env/testbed/cmd/testbed-pause", pause); err != nil {
			return err
		}
		if err := ociimage.GoBinary(ctx, root, "./internal/env/testbed/cmd/testbed-echo", echo); err != nil {
			return err
		}
		err := ociimage.BuildArchive(ctx, filepath.Join(tmp, "images.tar"),
			ociimage.Options{Ref: PauseImage, Files: map[string]string{"/pause": pause}, Entrypoint: []string{"/pause"}, User: "65535:65535"},
			ociimage.Options{Ref: EchoImage, Files: map[string]string{"/echo": echo}, Dirs: map[string]os.FileMode{"/tmp": os.ModeSticky | 0o777}, Entrypoint: []string{"/echo"}},
		)
		if err != nil {
			return err
		}
		_ = os.Remove(pause)
		_ = os.Remove(echo)
		return nil
	})
	if err != nil {
		return fmt.Errorf("build test bed helpers: %w", err)
	}
	log.Info("built CNI plugins and images", "dir", b.AuxDir, "took", time.Since(start).Round(time.Millisecond))
	return nil
}
