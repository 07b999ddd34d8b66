package ociimage

import (
	"github.com/meshcni/meshcni/internal/testkit/testutil"

	"archive/tar"
	"context"
	"debug/elf"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

func TestBuildArchiveRoundTrip(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "hello")
	if err := os.WriteFile(bin, []byte("#!binary\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "img.tar")
	opts := Options{
		Ref:        "meshcni.local/test/hello:dev",
		Files:      map[string]string{"/usr/bin/hello": bin},
		Dirs:       map[string]os.FileMode{"/tmp": os.ModeSticky | 0o777},
		Entrypoint: []string{"/usr/bin/hello"},
		Cmd:        []string{"serve"},
		Env:        []string{"A=b"},
		User:       "1337:1337",
		Labels:     map[string]string{"app": "hello"},
	}
	ctx := context.Background()
	if err := BuildArchive(ctx, out, opts, Options{Ref: "registry.k8s.io/pause:3.10", Files: map[string]string{"/pause": bin}, Entrypoint: []string{"/pause"}}); err != nil {
		t.Fatal(err)
	}

	// The archive's manifest.json lists both tags.
	f, err := os.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var manifest []struct{ RepoTags []string }
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if h.Name == "manifest.json" {
			if err := json.NewDecoder(tr).Decode(&manifest); err != nil {
				t.Fatal(err)
			}
		}
	}
	tags := map[string]bool{}
	for _, m := range manifest {
		for _, tg := range m.RepoTags {
			tags[tg] = true
		}
	}
	if !tags["meshcni.local/test/hello:dev"] || !tags["registry.k8s.io/pause:3.10"] {
		t.Fatalf("manifest tags = %v", tags)
	}

	// Read the image back: config and layer content.
	tag, _ := name.NewTag("meshcni.local/test/hello:dev")
	img, err := tarball.ImageFromPath(out, &tag)
	if err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if cf.OS != "linux" || cf.Config.User != "1337:1337" || cf.Config.Entrypoint[0] != "/usr/bin/hello" || cf.Config.Cmd[0] != "serve" || cf.Config.Labels["app"] != "hello" {
		t.Fatalf("config = %+v", cf.Config)
	}
	layers, err := img.Layers()
	if err != nil || len(layers) != 1 {
		t.Fatalf("layers = %d, %v", len(layers), err)
	}
	rc, err := layers[0].Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	got := map[string]*tar.Header{}
	ltr := tar.NewReader(rc)
	for {
		h, err := ltr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		got[h.Name] = h
	}
	for _, want := range []string{"usr/", "usr/bin/", "usr/bin/hello", "tmp/"} {
		if got[want] == nil {
			t.Errorf("layer lacks %s (has %v)", want, keys(got))
		}
	}
	if h := got["usr/bin/hello"]; h != nil && h.Mode&0o777 != 0o755 {
		t.Errorf("mode = %o", h.Mode)
	}
	if h := got["tmp/"]; h != nil && h.Mode&0o1000 == 0 {
		t.Errorf("tmp not sticky: %o", h.Mode)
	}
}

func TestBuildIsReproducible(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "x")
	if err := os.WriteFile(bin, []byte("x"), 0o755); err != nil {
		t.Fatal(err)
	}
	digest := func() string {
		im, err := Build(context.Background(), Options{Ref: "a/b:c", Files: map[string]string{"/x": bin, "/a/b/c": bin}})
		if err != nil {
			t.Fatal(err)
		}
		d, err := im.Image.Digest()
		if err != nil {
			t.Fatal(err)
		}
		return d.String()
	}
	if a, b := digest(), digest(); a != b {
		t.Fatalf("digests differ: %s vs %s", a, b)
	}
}

func TestBuildRejectsBadInput(t *testing.T) {
	ctx := context.Background()
	if _, err := Build(ctx, Options{Ref: "UPPER/case:x"}); err == nil {
		t.Error("bad reference accepted")
	}
	if _, err := Build(ctx, Options{Ref: "a/b:c", Files: map[string]string{"relative": "/etc/hostname"}}); err == nil {
		t.Error("relative path accepted")
	}
	if _, err := Build(ctx, Options{Ref: "a/b:c", Files: map[string]string{"/x": "/nonexistent/file"}}); err == nil {
		t.Error("missing host file accepted")
	}
}

func keys(m map[string]*tar.Header) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

func TestGoBinaryIsStatic(t *testing.T) {
	testutil.RequireBinary(t, "go")
	out := filepath.Join(t.TempDir(), "hello")
	if err := GoBinary(context.Background(), ".", "./testdata/hello", out); err != nil {
		t.Fatal(err)
	}
	f, err := elf.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			t.Fatal("binary is dynamically linked")
		}
	}
	got, err := exec.Command(out).Output()
	if err != nil || string(got) != "hello\n" {
		t.Fatalf("run: %q, %v", got, err)
	}
}
