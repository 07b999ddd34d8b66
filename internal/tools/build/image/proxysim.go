package image

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/google/go-containerregistry/pkg/name"

	"github.com/meshcni/meshcni/internal/tools/build/ociimage"
)

// The stand-in sidecar proxy's image: a test and demo tool, never part of the
// product image.
const (
	// ProxysimName is its repository name under the hub.
	ProxysimName = "meshcni-proxysim"
	// ProxysimPackage is the main package of its one command.
	ProxysimPackage = "./hack/proxysim"
	// ProxysimPath is the command's place in the image (its entrypoint).
	ProxysimPath = "/usr/local/bin/meshcni-proxysim"
)

// ProxysimRef is the stand-in proxy's image reference for hub and tag, validated.
func ProxysimRef(hub, tag string) (string, error) {
	ref := hub + "/" + ProxysimName + ":" + tag
	if _, err := name.NewTag(ref, name.StrictValidation); err != nil {
		return "", fmt.Errorf("image reference %q (hub %q, tag %q): %w", ref, hub, tag, err)
	}
	return ref, nil
}

// BuildProxysim builds the stand-in proxy (hack/proxysim, static, for this machine's
// architecture) into a FROM-scratch image archive at out, for `ctr images import`:
// the command at ProxysimPath as entrypoint, /tmp 1777, no user (pods set theirs).
// It returns the image reference.
func BuildProxysim(ctx context.Context, repoRoot, hub, tag, out string) (string, error) {
	ref, err := ProxysimRef(hub, tag)
	if err != nil {
		return "", err
	}
	work, err := os.MkdirTemp("", "meshcni-proxysim-image-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(work)
	bin := filepath.Join(work, ProxysimName)
	if err := ociimage.GoBinary(ctx, repoRoot, ProxysimPackage, bin); err != nil {
		return "", fmt.Errorf("build %s: %w", ProxysimPackage, err)
	}
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		return "", err
	}
	err = ociimage.BuildArchive(ctx, out, ociimage.Options{
		Ref:        ref,
		Files:      map[string]string{ProxysimPath: bin},
		Dirs:       map[string]os.FileMode{"/tmp": os.ModeSticky | 0o777},
		Entrypoint: []string{ProxysimPath},
		Labels:     map[string]string{"org.opencontainers.image.source": Source, "org.opencontainers.image.title": ProxysimName},
	})
	if err != nil {
		return "", fmt.Errorf("image %s: %w", ref, err)
	}
	return ref, nil
}

// ProxysimArchive is where the demo writes the stand-in's archive for tag:
// <repoRoot>/bin/images/meshcni-proxysim-<tag>.tar.
func ProxysimArchive(repoRoot, tag string) string {
	return filepath.Join(repoRoot, "bin", "images", ProxysimName+"-"+tag+".tar")
}
