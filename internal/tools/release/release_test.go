package release

import (
	"archive/tar"
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/meshcni/meshcni/internal/env/demo"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/internal/tools/build/image"
)

func TestParseVersion(t *testing.T) {
	for _, tc := range []struct {
		in string
		ok bool
	}{
		{"1.2.0", true},
		{"0.1.0", true},
		{"1.3.0-rc.1", true},
		{"10.20.30-alpha-2", true},
		{"v1.2.0", false},
		{"1.2", false},
		{"1.2.0+build5", false}, // an image tag cannot hold '+'
		{"01.2.0", false},
		{"1.2.0-", false},
		{"1.2.0-rc..1", false},
		{"1.2.0 ", false},
		{"", false},
	} {
		_, err := ParseVersion(tc.in)
		if (err == nil) != tc.ok {
			t.Errorf("ParseVersion(%q) = %v, want ok=%v", tc.in, err, tc.ok)
		}
	}
}

func TestSetHub(t *testing.T) {
	for _, tc := range []struct {
		name, values, hub, want, err string
	}{
		{name: "replaces", values: "# c\nhub: ghcr.io/meshcni\ntag: \"\"\n", hub: "registry.example:5000/team",
			want: "# c\nhub: registry.example:5000/team\ntag: \"\"\n"},
		{name: "nested hub untouched", values: "hub: a.io/x\nimage:\n  hub: b.io/y\n", hub: "c.io/z",
			want: "hub: c.io/z\nimage:\n  hub: b.io/y\n"},
		{name: "none", values: "tag: x\n", hub: "c.io/z", err: "found 0"},
		{name: "two", values: "hub: a\nhub: b\n", hub: "c.io/z", err: "found 2"},
		{name: "bad hub", values: "hub: a\n", hub: "C.io/Bad Hub", err: `hub "C.io/Bad Hub"`},
		{name: "newline in hub", values: "hub: a\n", hub: "c.io/z\nrbac: false", err: "hub"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := SetHub([]byte(tc.values), tc.hub)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("SetHub = %q, %v; want error containing %q", got, err, tc.err)
				}
				return
			}
			if err != nil || string(got) != tc.want {
				t.Fatalf("SetHub = %q, %v; want %q", got, err, tc.want)
			}
		})
	}
	// The chart's own values.yaml has exactly the one line SetHub rewrites.
	root, err := testutil.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	values, err := os.ReadFile(filepath.Join(root, ChartDir, "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := SetHub(values, DefaultHub); err != nil {
		t.Fatalf("the chart's values.yaml: %v", err)
	}
}

func helmFor(t *testing.T, root string) string {
	t.Helper()
	testutil.Unit(t, "helm and a Go build of every command")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	helm, err := demo.HelmPath(ctx, root)
	if err != nil {
		testutil.Missing(t, "helm: %v", err)
	}
	return helm
}

// TestBuild builds a release for this machine's architecture (the multi-arch index is
// internal/tools/build/image's TestAssembleMultiArch) and checks every artifact: checksums,
// the chart's version and default image, the manifests' images, the archive's name.
func TestBuild(t *testing.T) {
	root, err := testutil.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	helm := helmFor(t, root)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	const version, hub = "1.2.3-rc.1", "meshcni.local/release"
	out := filepath.Join(t.TempDir(), "dist", version)
	opts := Options{RepoRoot: root, Version: version, Hub: hub, Arches: []image.Arch{image.HostArch()}, Out: out, Helm: helm}

	// Bad input leaves nothing behind.
	bad := opts
	bad.Version = "v1.2.3"
	if _, err := Build(ctx, bad); err == nil || !strings.Contains(err.Error(), "no leading v") {
		t.Errorf("Build(version v1.2.3) = %v", err)
	}
	if _, err := os.Stat(filepath.Dir(out)); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("a refused build created %s (%v)", filepath.Dir(out), err)
	}

	res, err := Build(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("release %s built in %s: %v", res.Pinned(), res.Took.Round(time.Millisecond), res.Files)
	if want := hub + "/meshcni:" + version; res.Ref != want {
		t.Errorf("Ref = %s, want %s", res.Ref, want)
	}
	files, err := VerifySums(out)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"IMAGE", "meshcni-" + version + ".oci.tar", "meshcni-" + version + ".tgz", "meshcni-standalone.yaml", "meshcni.yaml"}
	if !slices.Equal(files, want) {
		t.Errorf("SHA256SUMS lists %v, want %v", files, want)
	}
	entries, _ := os.ReadDir(filepath.Dir(out))
	if len(entries) != 1 {
		t.Errorf("staging left behind next to the release: %v", entries)
	}
	if pinned, _ := os.ReadFile(filepath.Join(out, "IMAGE")); string(pinned) != res.Pinned()+"\n" || !strings.Contains(res.Pinned(), "@sha256:") {
		t.Errorf("IMAGE = %q, want %q", pinned, res.Pinned())
	}

	// The archive names the image by its reference, and its index is the digest IMAGE pins.
	index := readTarFile(t, filepath.Join(out, res.Image), "index.json", false)
	var idx struct {
		Manifests []struct {
			Digest      string            `json:"digest"`
			Annotations map[string]string `json:"annotations"`
		} `json:"manifests"`
	}
	if err := json.Unmarshal(index, &idx); err != nil {
		t.Fatalf("index.json: %v", err)
	}
	if len(idx.Manifests) != 1 || idx.Manifests[0].Annotations[image.AnnotationImageName] != res.Ref || idx.Manifests[0].Digest != res.IndexDigest {
		t.Errorf("index.json = %s; want one manifest named %s with digest %s", index, res.Ref, res.IndexDigest)
	}

	// The packaged chart: version, appVersion, and the release's hub as its default.
	chartYAML := readTarFile(t, filepath.Join(out, res.Chart), "meshcni/Chart.yaml", true)
	var chart struct{ Version, AppVersion string }
	if err := yaml.Unmarshal(chartYAML, &chart); err != nil {
		t.Fatal(err)
	}
	if chart.Version != version || chart.AppVersion != version {
		t.Errorf("packaged Chart.yaml version %q appVersion %q, want %q", chart.Version, chart.AppVersion, version)
	}
	values := readTarFile(t, filepath.Join(out, res.Chart), "meshcni/values.yaml", true)
	if !strings.Contains(string(values), "\nhub: "+hub+"\n") {
		t.Errorf("packaged values.yaml has not hub %s", hub)
	}

	// Every container of both manifests runs the image built.
	for _, m := range res.Manifests {
		data, err := os.ReadFile(filepath.Join(out, m))
		if err != nil {
			t.Fatal(err)
		}
		images := 0
		for _, line := range strings.Split(string(data), "\n") {
			if v, ok := strings.CutPrefix(strings.TrimSpace(line), "image: "); ok {
				images++
				if strings.Trim(v, `"`) != res.Ref {
					t.Errorf("%s: image %s, want %s", m, v, res.Ref)
				}
			}
		}
		if images < 2 {
			t.Errorf("%s: %d images, want the agent's and the taint controller's", m, images)
		}
	}

	// A second build into the same directory is refused; the first stays intact.
	if _, err := Build(ctx, opts); err == nil || !strings.Contains(err.Error(), "exists") {
		t.Errorf("second Build into %s = %v", out, err)
	}
	if _, err := VerifySums(out); err != nil {
		t.Errorf("after the refused build: %v", err)
	}
}

// readTarFile returns one file of a tar (gzipped or not).
func readTarFile(t *testing.T, archive, name string, gz bool) []byte {
	t.Helper()
	f, err := os.Open(archive)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var r io.Reader = f
	if gz {
		zr, err := gzip.NewReader(f)
		if err != nil {
			t.Fatal(err)
		}
		r = zr
	}
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if err != nil {
			t.Fatalf("%s: no %s (%v)", archive, name, err)
		}
		if h.Name == name {
			data, err := io.ReadAll(tr)
			if err != nil {
				t.Fatal(err)
			}
			return data
		}
	}
}
