// Package release builds meshcni's release artifacts (`make release VERSION=x.y.z`):
// the multi-arch image as an OCI layout archive (internal/tools/build/image), the Helm chart
// packaged with that version whose default image is the one built, the plain manifests
// rendered from that packaged chart, the image's reference with its digest, and a
// SHA256SUMS file over all of them. The artifacts are written into a temporary
// directory next to the output directory and renamed into place once complete, so a
// failed build leaves no partial release. docs/release.md says how to publish them.
package release

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/meshcni/meshcni/internal/tools/build/image"
)

// DefaultHub is where released images live: the chart's default hub.
const DefaultHub = "ghcr.io/meshcni"

// ChartDir is the chart's directory inside the repository.
const ChartDir = "deploy/charts/meshcni"

// Namespace and Release name the plain manifests' install (as deploy/manifests).
const (
	Namespace = "meshcni-system"
	Release   = "meshcni"
)

// semver is a release version: MAJOR.MINOR.PATCH with an optional pre-release, no
// leading "v" and no build metadata (an image tag cannot hold "+").
var semver = regexp.MustCompile(`^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)(-[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?$`)

// ParseVersion checks a release version.
func ParseVersion(v string) (string, error) {
	if !semver.MatchString(v) {
		return "", fmt.Errorf("version %q: want MAJOR.MINOR.PATCH[-PRERELEASE] (e.g. 1.2.0, 1.3.0-rc.1), no leading v", v)
	}
	return v, nil
}

// Options describe one release build.
type Options struct {
	RepoRoot string
	// Version is the release version: image tag, chart version and appVersion.
	Version string
	// Hub is the image's registry and namespace (DefaultHub when empty); it becomes the
	// packaged chart's default `hub`.
	Hub string
	// Arches to build; amd64 and arm64 when empty.
	Arches []image.Arch
	// Out is the release directory; it must not exist yet.
	Out string
	// Helm is the helm binary.
	Helm   string
	Logger *slog.Logger
}

// Result lists what was written (file names relative to Out).
type Result struct {
	Out         string
	Ref         string // <hub>/meshcni:<version>
	IndexDigest string // the image index's digest
	Image       string // image archive
	Chart       string // packaged chart
	Manifests   []string
	Files       []string // every artifact, SHA256SUMS last
	Took        time.Duration
}

// Pinned is the image reference with its digest, as the release's IMAGE file holds it.
func (r *Result) Pinned() string { return r.Ref + "@" + r.IndexDigest }

// manifestSets are the plain manifests of a release: file name, helm --set values.
var manifestSets = []struct {
	file   string
	values []string
}{
	{"meshcni.yaml", nil},
	{"meshcni-standalone.yaml", []string{"chained=false", "cniConfDir=/etc/cni/multus/net.d"}},
}

// Build writes a release into opts.Out.
func Build(ctx context.Context, opts Options) (*Result, error) {
	began := time.Now()
	log := opts.Logger
	if log == nil {
		log = slog.Default()
	}
	version, err := ParseVersion(opts.Version)
	if err != nil {
		return nil, err
	}
	hub := opts.Hub
	if hub == "" {
		hub = DefaultHub
	}
	ref, err := image.Ref(hub, version)
	if err != nil {
		return nil, err
	}
	arches := opts.Arches
	if len(arches) == 0 {
		if arches, err = image.ParseArches("amd64,arm64"); err != nil {
			return nil, err
		}
	}
	if opts.Helm == "" {
		return nil, errors.New("release: no helm binary given")
	}
	out, err := filepath.Abs(opts.Out)
	if err != nil {
		return nil, fmt.Errorf("release directory %q: %w", opts.Out, err)
	}
	if _, err := os.Lstat(out); err == nil {
		return nil, fmt.Errorf("release directory %s exists: remove it or choose another", out)
	} else if !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("release directory %s: %w", out, err)
	}
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		return nil, fmt.Errorf("release directory's parent: %w", err)
	}
	tmp, err := os.MkdirTemp(filepath.Dir(out), "."+filepath.Base(out)+".tmp-")
	if err != nil {
		return nil, fmt.Errorf("release staging directory: %w", err)
	}
	published := false
	defer func() {
		if !published {
			_ = os.RemoveAll(tmp)
		}
	}()

	res := &Result{Out: out, Ref: ref}
	// 1. The image.
	res.Image = "meshcni-" + version + ".oci.tar"
	log.Info("building the image", "ref", ref, "arches", fmt.Sprint(arches))
	img, err := image.Build(ctx, image.Options{
		RepoRoot: opts.RepoRoot, Hub: hub, Tag: version, Arches: arches, Version: version,
		Out: filepath.Join(tmp, res.Image), Logger: log,
	})
	if err != nil {
		return nil, fmt.Errorf("image: %w", err)
	}
	res.IndexDigest = img.IndexDigest
	if err := os.WriteFile(filepath.Join(tmp, "IMAGE"), []byte(res.Pinned()+"\n"), 0o644); err != nil {
		return nil, fmt.Errorf("IMAGE: %w", err)
	}

	// 2. The chart, its default hub the release's, packaged with the version.
	chartCopy := filepath.Join(tmp, ".chart", "meshcni")
	if err := copyTree(filepath.Join(opts.RepoRoot, ChartDir), chartCopy); err != nil {
		return nil, fmt.Errorf("copy the chart: %w", err)
	}
	valuesPath := filepath.Join(chartCopy, "values.yaml")
	values, err := os.ReadFile(valuesPath)
	if err != nil {
		return nil, fmt.Errorf("chart values: %w", err)
	}
	values, err = SetHub(values, hub)
	if err != nil {
		return nil, fmt.Errorf("chart values.yaml: %w", err)
	}
	if err := os.WriteFile(valuesPath, values, 0o644); err != nil {
		return nil, fmt.Errorf("chart values: %w", err)
	}
	if _, err := helm(ctx, opts.Helm, "package", chartCopy, "--version", version, "--app-version", version, "--destination", tmp); err != nil {
		return nil, err
	}
	res.Chart = "meshcni-" + version + ".tgz"
	if _, err := os.Stat(filepath.Join(tmp, res.Chart)); err != nil {
		return nil, fmt.Errorf("helm package wrote no %s: %w", res.Chart, err)
	}
	if err := os.RemoveAll(filepath.Join(tmp, ".chart")); err != nil {
		return nil, err
	}

	// 3. Plain manifests from the packaged chart (what users install is what was packaged).
	for _, m := range manifestSets {
		args := []string{"template", Release, filepath.Join(tmp, res.Chart), "--namespace", Namespace}
		for _, v := range m.values {
			args = append(args, "--set", v)
		}
		rendered, err := helm(ctx, opts.Helm, args...)
		if err != nil {
			return nil, err
		}
		var b bytes.Buffer
		fmt.Fprintf(&b, "# meshcni %s plain manifests, rendered from %s (helm template%s).\n", version, res.Chart, setFlags(m.values))
		fmt.Fprintf(&b, "# Install: kubectl apply --server-side -f %s\n---\n", m.file)
		fmt.Fprintf(&b, namespaceDoc, Namespace)
		b.WriteString(rendered)
		if err := os.WriteFile(filepath.Join(tmp, m.file), b.Bytes(), 0o644); err != nil {
			return nil, err
		}
		res.Manifests = append(res.Manifests, m.file)
	}

	// 4. Checksums over everything.
	res.Files = append([]string{res.Image, "IMAGE", res.Chart}, res.Manifests...)
	var sums bytes.Buffer
	for _, f := range res.Files {
		sum, err := fileSHA256(filepath.Join(tmp, f))
		if err != nil {
			return nil, err
		}
		fmt.Fprintf(&sums, "%s  %s\n", sum, f)
	}
	if err := os.WriteFile(filepath.Join(tmp, "SHA256SUMS"), sums.Bytes(), 0o644); err != nil {
		return nil, err
	}
	res.Files = append(res.Files, "SHA256SUMS")
	if err := os.Chmod(tmp, 0o755); err != nil {
		return nil, err
	}
	if err := os.Rename(tmp, out); err != nil {
		return nil, fmt.Errorf("publish the release directory: %w", err)
	}
	published = true
	res.Took = time.Since(began)
	return res, nil
}

// namespaceDoc is the Namespace the manifests install into (Pod Security Admission:
// privileged, as deploy/manifests).
const namespaceDoc = `apiVersion: v1
kind: Namespace
metadata:
  name: %s
  labels:
    pod-security.kubernetes.io/enforce: privileged
    app.kubernetes.io/name: meshcni
    app.kubernetes.io/part-of: meshcni
`

func setFlags(values []string) string {
	var b strings.Builder
	for _, v := range values {
		b.WriteString(" --set " + v)
	}
	return b.String()
}

// hubLine is the chart's top-level hub value.
var hubLine = regexp.MustCompile(`(?m)^hub:[^\n]*$`)

// SetHub sets the top-level `hub:` of a chart's values.yaml, keeping everything else
// (comments included) byte for byte. The file must hold exactly one such line.
func SetHub(values []byte, hub string) ([]byte, error) {
	if _, err := image.Ref(hub, "0.0.0"); err != nil {
		return nil, fmt.Errorf("hub %q: %w", hub, err)
	}
	if n := len(hubLine.FindAll(values, -1)); n != 1 {
		return nil, fmt.Errorf("want exactly one top-level `hub:` line, found %d", n)
	}
	return hubLine.ReplaceAll(values, []byte("hub: "+hub)), nil
}

func helm(ctx context.Context, bin string, args ...string) (string, error) {
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("helm %s: %w\n%s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return stdout.String(), nil
}

func fileSHA256(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", fmt.Errorf("checksum %s: %w", path, err)
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// copyTree copies regular files and directories (the chart has nothing else).
func copyTree(src, dst string) error {
	return filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(src, p)
		if err != nil {
			return err
		}
		target := filepath.Join(dst, rel)
		switch {
		case d.IsDir():
			return os.MkdirAll(target, 0o755)
		case d.Type().IsRegular():
			data, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			return os.WriteFile(target, data, 0o644)
		default:
			return fmt.Errorf("%s: not a regular file or directory", p)
		}
	})
}

// VerifySums checks a release directory against its SHA256SUMS and returns the files
// it lists, sorted.
func VerifySums(dir string) ([]string, error) {
	data, err := os.ReadFile(filepath.Join(dir, "SHA256SUMS"))
	if err != nil {
		return nil, err
	}
	var files []string
	for i, line := range strings.Split(strings.TrimRight(string(data), "\n"), "\n") {
		sum, file, ok := strings.Cut(line, "  ")
		if !ok || len(sum) != 64 || file == "" || strings.ContainsRune(file, '/') {
			return nil, fmt.Errorf("SHA256SUMS line %d: malformed %q", i+1, line)
		}
		got, err := fileSHA256(filepath.Join(dir, file))
		if err != nil {
			return nil, err
		}
		if got != sum {
			return nil, fmt.Errorf("%s: sha256 %s, SHA256SUMS says %s", file, got, sum)
		}
		files = append(files, file)
	}
	slices.Sort(files)
	return files, nil
}
