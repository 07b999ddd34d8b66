package image

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"slices"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/meshcni/meshcni/internal/tools/build/ociimage"
	"github.com/meshcni/meshcni/pkg/fileutil"
)

// Annotation keys on the index.json descriptor.
const (
	// AnnotationImageName is what containerd (`ctr images import`) and Docker 25+
	// name an imported image by.
	AnnotationImageName = "io.containerd.image.name"
	// AnnotationRefName is the OCI image-layout reference name (the tag).
	AnnotationRefName = "org.opencontainers.image.ref.name"
)

// AssembleOptions describe an archive of already built binaries.
type AssembleOptions struct {
	Ref, Tag          string
	Version, Revision string
	Arches            []Arch
	// Binaries maps each architecture to command name → host file.
	Binaries map[Arch]map[string]string
	Out      string
}

// Labels are the OCI labels of the image config (and annotations of the index).
func Labels(version, revision string) map[string]string {
	return map[string]string{
		"org.opencontainers.image.title":       Name,
		"org.opencontainers.image.description": "meshcni: CNI plugin, node agent and tools for service-mesh sidecar traffic redirect",
		"org.opencontainers.image.source":      Source,
		"org.opencontainers.image.url":         Source,
		"org.opencontainers.image.version":     version,
		"org.opencontainers.image.revision":    revision,
	}
}

// Assemble builds one image per architecture from the given binaries, puts them in an
// OCI image index and writes the archive (see the package comment).
func Assemble(ctx context.Context, o AssembleOptions) (*Result, error) {
	if len(o.Arches) == 0 {
		return nil, fmt.Errorf("images: no architecture")
	}
	labels := Labels(o.Version, o.Revision)
	idx := mutate.IndexMediaType(empty.Index, types.OCIImageIndex)
	res := &Result{Ref: o.Ref, Out: o.Out, Version: o.Version, Revision: o.Revision}
	var imgs []v1.Image
	for _, a := range o.Arches {
		bins, ok := o.Binaries[a]
		if !ok {
			return nil, fmt.Errorf("images: no binaries for %s", a)
		}
		built, err := ociimage.Build(ctx, imageOptions(o.Ref, a, bins, labels))
		if err != nil {
			return nil, err
		}
		img, err := toOCI(built.Image, a)
		if err != nil {
			return nil, fmt.Errorf("image for %s: %w", a, err)
		}
		d, err := img.Digest()
		if err != nil {
			return nil, err
		}
		p := Platform{Arch: a, Digest: d.String(), Commands: map[string]int64{}}
		ls, err := img.Layers()
		if err != nil {
			return nil, err
		}
		for _, l := range ls {
			sz, err := l.Size()
			if err != nil {
				return nil, err
			}
			p.Size += sz
		}
		for c, f := range bins {
			st, err := os.Stat(f)
			if err != nil {
				return nil, err
			}
			p.Commands[c] = st.Size()
		}
		res.Platforms = append(res.Platforms, p)
		imgs = append(imgs, img)
		idx = mutate.AppendManifests(idx, mutate.IndexAddendum{
			Add: img,
			Descriptor: v1.Descriptor{
				MediaType: types.OCIManifestSchema1,
				Platform:  &v1.Platform{OS: "linux", Architecture: a.GOARCH, Variant: a.Variant},
			},
		})
	}
	idx = mutate.Annotations(idx, labels).(v1.ImageIndex)
	d, err := idx.Digest()
	if err != nil {
		return nil, err
	}
	res.IndexDigest = d.String()
	var buf bytes.Buffer
	if err := writeLayout(&buf, o.Ref, o.Tag, idx, imgs); err != nil {
		return nil, fmt.Errorf("write %s: %w", o.Out, err)
	}
	if err := os.MkdirAll(filepath.Dir(o.Out), 0o755); err != nil {
		return nil, err
	}
	if err := fileutil.WriteFileAtomic(o.Out, buf.Bytes(), 0o644); err != nil {
		return nil, err
	}
	res.ArchiveSize = int64(buf.Len())
	return res, nil
}

// toOCI rebuilds img with OCI media types (manifest, config, layers) and the
// platform variant in its config.
func toOCI(img v1.Image, a Arch) (v1.Image, error) {
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.Variant = a.Variant
	ls, err := img.Layers()
	if err != nil {
		return nil, err
	}
	out := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	out = mutate.ConfigMediaType(out, types.OCIConfigJSON)
	for _, l := range ls {
		gz, err := gzipLayer(l)
		if err != nil {
			return nil, err
		}
		// Compressed input is used as is (go-containerregistry would otherwise
		// recompress at every read of the digest, size or content).
		nl, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
			return io.NopCloser(bytes.NewReader(gz)), nil
		}, tarball.WithMediaType(types.OCILayer))
		if err != nil {
			return nil, err
		}
		if out, err = mutate.AppendLayers(out, nl); err != nil {
			return nil, err
		}
	}
	return mutate.ConfigFile(out, cf)
}

// gzipLayer compresses a layer's tar once, deterministically (no name, no time in
// the gzip header).
func gzipLayer(l v1.Layer) ([]byte, error) {
	rc, err := l.Uncompressed()
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	var buf bytes.Buffer
	zw, err := gzip.NewWriterLevel(&buf, gzip.DefaultCompression)
	if err != nil {
		return nil, err
	}
	if _, err := io.Copy(zw, rc); err != nil {
		return nil, err
	}
	if err := zw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// writeLayout writes an OCI image layout as a tar stream: entries sorted, times at
// the epoch, so the bytes depend only on the content.
func writeLayout(w io.Writer, ref, tag string, idx v1.ImageIndex, imgs []v1.Image) error {
	files := map[string][]byte{}
	blob := func(h v1.Hash, data []byte) string {
		p := "blobs/" + h.Algorithm + "/" + h.Hex
		files[p] = data
		return p
	}
	var dockerManifest []map[string]any
	for i, img := range imgs {
		raw, err := img.RawManifest()
		if err != nil {
			return err
		}
		d, err := img.Digest()
		if err != nil {
			return err
		}
		blob(d, raw)
		rawCfg, err := img.RawConfigFile()
		if err != nil {
			return err
		}
		cd, err := img.ConfigName()
		if err != nil {
			return err
		}
		cfgPath := blob(cd, rawCfg)
		ls, err := img.Layers()
		if err != nil {
			return err
		}
		var layerPaths []string
		for _, l := range ls {
			ld, err := l.Digest()
			if err != nil {
				return err
			}
			rc, err := l.Compressed()
			if err != nil {
				return err
			}
			data, err := io.ReadAll(rc)
			rc.Close()
			if err != nil {
				return err
			}
			layerPaths = append(layerPaths, blob(ld, data))
		}
		if i == 0 {
			dockerManifest = append(dockerManifest, map[string]any{
				"Config": cfgPath, "RepoTags": []string{ref}, "Layers": layerPaths,
			})
		}
	}
	rawIdx, err := idx.RawManifest()
	if err != nil {
		return err
	}
	idxDigest, err := idx.Digest()
	if err != nil {
		return err
	}
	blob(idxDigest, rawIdx)
	top := v1.IndexManifest{
		SchemaVersion: 2,
		MediaType:     types.OCIImageIndex,
		Manifests: []v1.Descriptor{{
			MediaType: types.OCIImageIndex,
			Size:      int64(len(rawIdx)),
			Digest:    idxDigest,
			Annotations: map[string]string{
				AnnotationImageName: ref,
				AnnotationRefName:   tag,
			},
		}},
	}
	if files["index.json"], err = json.Marshal(top); err != nil {
		return err
	}
	files["oci-layout"] = []byte(`{"imageLayoutVersion":"1.0.0"}`)
	if files["manifest.json"], err = json.Marshal(dockerManifest); err != nil {
		return err
	}

	names := make([]string, 0, len(files))
	for n := range files {
		names = append(names, n)
	}
	slices.Sort(names)
	tw := tar.NewWriter(w)
	epoch := time.Unix(0, 0).UTC()
	dirs := map[string]bool{}
	for _, n := range names {
		var parents []string
		for d := path.Dir(n); d != "."; d = path.Dir(d) {
			parents = append([]string{d}, parents...)
		}
		for _, d := range parents {
			if dirs[d] {
				continue
			}
			dirs[d] = true
			if err := tw.WriteHeader(&tar.Header{Name: d + "/", Typeflag: tar.TypeDir, Mode: 0o755, ModTime: epoch, Format: tar.FormatPAX}); err != nil {
				return err
			}
		}
		data := files[n]
		if err := tw.WriteHeader(&tar.Header{Name: n, Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(data)), ModTime: epoch, Format: tar.FormatPAX}); err != nil {
			return err
		}
		if _, err := tw.Write(data); err != nil {
			return err
		}
	}
	return tw.Close()
}
