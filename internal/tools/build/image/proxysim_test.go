package image

import (
	"archive/tar"
	"context"
	"io"
	"path/filepath"
	"testing"

	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
)

// TestBuildProxysim builds the stand-in proxy's image for real and reads it back:
// one command, at its path, as the entrypoint; nothing of the product in it.
func TestBuildProxysim(t *testing.T) {
	testutil.RequireBinary(t, "go")
	root, err := testbed.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(t.TempDir(), "proxysim.tar")
	ref, err := BuildProxysim(context.Background(), root, "meshcni.local", "t1", out)
	if err != nil {
		t.Fatal(err)
	}
	if ref != "meshcni.local/meshcni-proxysim:t1" {
		t.Errorf("ref %q", ref)
	}
	img, err := tarball.ImageFromPath(out, nil) // a docker archive, as ctr imports it
	if err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if len(cf.Config.Entrypoint) != 1 || cf.Config.Entrypoint[0] != "/usr/local/bin/meshcni-proxysim" {
		t.Errorf("entrypoint %v", cf.Config.Entrypoint)
	}
	ls, err := img.Layers()
	if err != nil || len(ls) != 1 {
		t.Fatalf("layers %d, %v; want 1", len(ls), err)
	}
	rc, err := ls[0].Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	var regular []string
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if h.Typeflag == tar.TypeReg {
			regular = append(regular, "/"+h.Name)
		}
	}
	if len(regular) != 1 || regular[0] != "/usr/local/bin/meshcni-proxysim" {
		t.Errorf("files %v, want only /usr/local/bin/meshcni-proxysim", regular)
	}
	if _, err := BuildProxysim(context.Background(), root, "meshcni.local", "bad tag", out); err == nil {
		t.Error("a bad tag: no error")
	}
}
