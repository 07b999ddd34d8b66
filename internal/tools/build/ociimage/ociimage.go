// Package ociimage builds small container images without Docker: a single layer of
// host files (typically static Go binaries) on top of scratch, written as a
// docker-archive tarball that `ctr images import` (and `docker load`) accept.
//
// Builds are reproducible: file times are the Unix epoch, owners are root and the
// layer order is sorted by path, so the same inputs give the same image digest.
package ociimage

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"runtime"
	"sort"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// Options describes one image.
type Options struct {
	// Ref is the image reference the archive is tagged with, e.g.
	// "registry.k8s.io/pause:3.10" or "meshcni.local/echo:dev". A reference without
	// a tag gets ":latest".
	Ref string
	// Files maps an absolute path inside the image to a file on the host. The host
	// file's permission bits are kept; parent directories are created (0755).
	Files map[string]string
	// Dirs are extra empty directories to create inside the image, with their mode
	// (e.g. "/tmp": 01777).
	Dirs map[string]os.FileMode
	// Entrypoint, Cmd, Env, User, WorkingDir and Labels go into the image config.
	Entrypoint []string
	Cmd        []string
	Env        []string
	User       string
	WorkingDir string
	Labels     map[string]string
	// Arch is the image architecture; runtime.GOARCH when empty. OS is always linux.
	Arch string
}

// Image is a built image and the tag it is written under.
type Image struct {
	Tag   name.Tag
	Image v1.Image
}

// Build assembles the image described by opts in memory.
func Build(ctx context.Context, opts Options) (*Image, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	tag, err := name.NewTag(opts.Ref)
	if err != nil {
		return nil, fmt.Errorf("image reference %q: %w", opts.Ref, err)
	}
	layerTar, err := layerTar(opts)
	if err != nil {
		return nil, fmt.Errorf("image %s: %w", opts.Ref, err)
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(layerTar)), nil
	})
	if err != nil {
		return nil, fmt.Errorf("image %s: layer: %w", opts.Ref, err)
	}
	img, err := mutate.AppendLayers(empty.Image, layer)
	if err != nil {
		return nil, fmt.Errorf("image %s: append layer: %w", opts.Ref, err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, fmt.Errorf("image %s: config: %w", opts.Ref, err)
	}
	cf = cf.DeepCopy()
	cf.OS = "linux"
	cf.Architecture = opts.Arch
	if cf.Architecture == "" {
		cf.Architecture = runtime.GOARCH
	}
	cf.Created = v1.Time{Time: time.Unix(0, 0).UTC()}
	cf.Config.Entrypoint = opts.Entrypoint
	cf.Config.Cmd = opts.Cmd
	cf.Config.Env = opts.Env
	cf.Config.User = opts.User
	cf.Config.WorkingDir = opts.WorkingDir
	cf.Config.Labels = opts.Labels
	img, err = mutate.ConfigFile(img, cf)
	if err != nil {
		return nil, fmt.Errorf("image %s: set config: %w", opts.Ref, err)
	}
	return &Image{Tag: tag, Image: img}, nil
}

// WriteArchive writes images into one docker-archive tarball at path (a
// manifest.json with RepoTags, which `ctr -n k8s.io images import` turns into
// image names).
func WriteArchive(path string, imgs ...*Image) error {
	if len(imgs) == 0 {
		return fmt.Errorf("write %s: no images", path)
	}
	m := make(map[name.Tag]v1.Image, len(imgs))
	for _, im := range imgs {
		m[im.Tag] = im.Image
	}
	if err := tarball.MultiWriteToFile(path, m); err != nil {
		return fmt.Errorf("write image archive %s: %w", path, err)
	}
	return nil
}

// BuildArchive builds every image and writes them all into one archive at path.
func BuildArchive(ctx context.Context, path string, opts ...Options) error {
	imgs := make([]*Image, 0, len(opts))
	for _, o := range opts {
		im, err := Build(ctx, o)
		if err != nil {
			return err
		}
		imgs = append(imgs, im)
	}
	return WriteArchive(path, imgs...)
}

// GoBinary builds a static Go program (CGO_ENABLED=0, -trimpath, stripped) for
// linux/GOARCH into out. dir is the directory the go command runs in (a directory of
// the module that holds pkg); pkg is a package path or a ./relative pattern.
func GoBinary(ctx context.Context, dir, pkg, out string) error {
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-ldflags=-s -w", "-o", out, pkg)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux")
	if outb, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build %s: %w: %s", pkg, err, strings.TrimSpace(string(outb)))
	}
	return nil
}

type entry struct {
	path string // clean, relative, no leading slash
	mode os.FileMode
	dir  bool
	src  string
}

func layerTar(opts Options) ([]byte, error) {
	entries := map[string]entry{}
	addParents := func(p string) {
		for d := path.Dir(p); d != "." && d != "/"; d = path.Dir(d) {
			if _, ok := entries[d]; !ok {
				entries[d] = entry{path: d, mode: 0o755, dir: true}
			}
		}
	}
	rel := func(p string) (string, error) {
		if !path.IsAbs(p) {
			return "", fmt.Errorf("path %q in image must be absolute", p)
		}
		c := strings.TrimPrefix(path.Clean(p), "/")
		if c == "" {
			return "", fmt.Errorf("path %q names the root", p)
		}
		return c, nil
	}
	for d, mode := range opts.Dirs {
		p, err := rel(d)
		if err != nil {
			return nil, err
		}
		addParents(p)
		entries[p] = entry{path: p, mode: mode, dir: true}
	}
	for dst, src := range opts.Files {
		p, err := rel(dst)
		if err != nil {
			return nil, err
		}
		st, err := os.Stat(src)
		if err != nil {
			return nil, fmt.Errorf("file for %s: %w", dst, err)
		}
		if !st.Mode().IsRegular() {
			return nil, fmt.Errorf("file for %s: %s is not a regular file", dst, src)
		}
		addParents(p)
		entries[p] = entry{path: p, mode: st.Mode(), src: src}
	}
	keys := make([]string, 0, len(entries))
	for k := range entries {
		keys = append(keys, k)
	}
	sort.Strings(keys)

	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	epoch := time.Unix(0, 0).UTC()
	for _, k := range keys {
		e := entries[k]
		hdr := &tar.Header{
			Name:    e.path,
			Mode:    int64(e.mode.Perm()) | int64(modeBits(e.mode)),
			ModTime: epoch,
			Format:  tar.FormatPAX,
		}
		if e.dir {
			hdr.Typeflag = tar.TypeDir
			hdr.Name += "/"
			if err := tw.WriteHeader(hdr); err != nil {
				return nil, err
			}
			continue
		}
		data, err := os.ReadFile(e.src)
		if err != nil {
			return nil, err
		}
		hdr.Typeflag = tar.TypeReg
		hdr.Size = int64(len(data))
		if err := tw.WriteHeader(hdr); err != nil {
			return nil, err
		}
		if _, err := tw.Write(data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// modeBits converts setuid/setgid/sticky to the tar header bits.
func modeBits(m os.FileMode) int64 {
	var b int64
	if m&os.ModeSetuid != 0 {
		b |= 0o4000
	}
	if m&os.ModeSetgid != 0 {
		b |= 0o2000
	}
	if m&os.ModeSticky != 0 {
		b |= 0o1000
	}
	return b
}
