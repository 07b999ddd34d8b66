package image

import (
	"archive/tar"
	"bytes"
	"context"
	"debug/elf"
	"encoding/json"
	"io"
	"os"
	"path"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
)

func TestParseArches(t *testing.T) {
	for _, tc := range []struct {
		in      string
		want    []string
		wantErr string
	}{
		{"", []string{HostArch().String()}, ""},
		{"amd64", []string{"amd64"}, ""},
		{"amd64, arm64", []string{"amd64", "arm64"}, ""},
		{"linux/arm64,arm", []string{"arm64", "arm/v7"}, ""},
		{"arm/v7,ppc64le,s390x,riscv64", []string{"arm/v7", "ppc64le", "s390x", "riscv64"}, ""},
		{"amd64,amd64", nil, `"amd64" given twice`},
		{"arm,arm/v7", nil, `"arm/v7" given twice`},
		{"x86", nil, `architecture "x86": want one of`},
		{"amd64,", nil, `architecture "": want one of`},
	} {
		got, err := ParseArches(tc.in)
		if tc.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("ParseArches(%q) = %v, %v; want error containing %q", tc.in, got, err, tc.wantErr)
			}
			continue
		}
		if err != nil {
			t.Errorf("ParseArches(%q): %v", tc.in, err)
			continue
		}
		var names []string
		for _, a := range got {
			names = append(names, a.String())
		}
		if !slices.Equal(names, tc.want) {
			t.Errorf("ParseArches(%q) = %v, want %v", tc.in, names, tc.want)
		}
	}
}

func TestRef(t *testing.T) {
	for _, tc := range []struct {
		hub, tag, want string
		wantErr        bool
	}{
		{"meshcni.local", "dev", "meshcni.local/meshcni:dev", false},
		{"ghcr.io/example", "v0.1.0", "ghcr.io/example/meshcni:v0.1.0", false},
		{"localhost:5000", "x", "localhost:5000/meshcni:x", false},
		{"meshcni.local", "bad tag", "", true},
		{"meshcni.local", "", "", true},
		{"meshcni.local/UPPER", "dev", "", true},
	} {
		got, err := Ref(tc.hub, tc.tag)
		if (err != nil) != tc.wantErr || got != tc.want {
			t.Errorf("Ref(%q, %q) = %q, %v; want %q (error %v)", tc.hub, tc.tag, got, err, tc.want, tc.wantErr)
		}
	}
}

func TestPathInImage(t *testing.T) {
	for cmd, want := range map[string]string{
		"meshcni":                  "/opt/meshcni/bin/meshcni",
		"meshcni-podget":           "/opt/meshcni/bin/meshcni-podget",
		"meshcni-agent":            "/usr/local/bin/meshcni-agent",
		"meshcnictl":               "/usr/local/bin/meshcnictl",
		"meshcni-taint-controller": "/usr/local/bin/meshcni-taint-controller",
	} {
		if got := PathInImage(cmd); got != want {
			t.Errorf("PathInImage(%q) = %q, want %q", cmd, got, want)
		}
	}
}

// fakeBinaries writes small distinct files standing in for the commands.
func fakeBinaries(t *testing.T, arches []Arch) map[Arch]map[string]string {
	t.Helper()
	dir := t.TempDir()
	out := map[Arch]map[string]string{}
	for _, a := range arches {
		m := map[string]string{}
		for _, c := range NodeCommands {
			p := filepath.Join(dir, a.GOARCH+a.Variant+"-"+c)
			if err := os.WriteFile(p, []byte("binary "+c+" for "+a.String()+"\n"), 0o755); err != nil {
				t.Fatal(err)
			}
			m[c] = p
		}
		out[a] = m
	}
	return out
}

// untar extracts an archive into a directory and returns its entries in order.
func untar(t *testing.T, archive, dir string) []string {
	t.Helper()
	f, err := os.Open(archive)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var names []string
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return names
		}
		if err != nil {
			t.Fatal(err)
		}
		names = append(names, h.Name)
		if !h.ModTime.Equal(h.ModTime.Truncate(0)) || h.ModTime.Unix() != 0 {
			t.Errorf("%s: mtime %v, want the epoch", h.Name, h.ModTime)
		}
		p := filepath.Join(dir, h.Name)
		if h.Typeflag == tar.TypeDir {
			if err := os.MkdirAll(p, 0o755); err != nil {
				t.Fatal(err)
			}
			continue
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func layerFiles(t *testing.T, img v1.Image) map[string]*tar.Header {
	t.Helper()
	ls, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	if len(ls) != 1 {
		t.Fatalf("%d layers, want 1", len(ls))
	}
	if mt, _ := ls[0].MediaType(); mt != types.OCILayer {
		t.Errorf("layer media type %s, want %s", mt, types.OCILayer)
	}
	rc, err := ls[0].Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	files := map[string]*tar.Header{}
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return files
		}
		if err != nil {
			t.Fatal(err)
		}
		files["/"+strings.TrimSuffix(h.Name, "/")] = h
	}
}

func TestAssembleMultiArch(t *testing.T) {
	arches := []Arch{{GOARCH: "amd64"}, {GOARCH: "arm64"}, {GOARCH: "arm", Variant: "v7"}}
	bins := fakeBinaries(t, arches)
	dir := t.TempDir()
	opts := AssembleOptions{
		Ref: "meshcni.local/meshcni:t1", Tag: "t1", Version: "v1.2.3", Revision: "abc123",
		Arches: arches, Binaries: bins, Out: filepath.Join(dir, "out", "meshcni-t1.tar"),
	}
	res, err := Assemble(context.Background(), opts)
	if err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(opts.Out)
	if err != nil {
		t.Fatal(err)
	}
	if st.Size() != res.ArchiveSize {
		t.Errorf("archive is %d bytes, result says %d", st.Size(), res.ArchiveSize)
	}
	if len(res.Platforms) != 3 {
		t.Fatalf("platforms %+v", res.Platforms)
	}

	// Reproducible: the same inputs give the same bytes.
	again := opts
	again.Out = filepath.Join(dir, "again.tar")
	res2, err := Assemble(context.Background(), again)
	if err != nil {
		t.Fatal(err)
	}
	a, _ := os.ReadFile(opts.Out)
	b, _ := os.ReadFile(again.Out)
	if res2.IndexDigest != res.IndexDigest || !bytes.Equal(a, b) {
		t.Errorf("two builds differ: %s vs %s (bytes equal %v)", res.IndexDigest, res2.IndexDigest, bytes.Equal(a, b))
	}

	ldir := filepath.Join(dir, "layout")
	names := untar(t, opts.Out, ldir)
	if !slices.IsSorted(names) {
		t.Errorf("entries not sorted: %v", names)
	}
	for _, want := range []string{"oci-layout", "index.json", "manifest.json", "blobs/", "blobs/sha256/"} {
		if !slices.Contains(names, want) {
			t.Errorf("archive lacks %s: %v", want, names)
		}
	}

	// index.json: one descriptor, the image index, named for containerd.
	var top v1.IndexManifest
	raw, _ := os.ReadFile(filepath.Join(ldir, "index.json"))
	if err := json.Unmarshal(raw, &top); err != nil {
		t.Fatal(err)
	}
	if len(top.Manifests) != 1 || top.Manifests[0].MediaType != types.OCIImageIndex ||
		top.Manifests[0].Annotations[AnnotationImageName] != "meshcni.local/meshcni:t1" ||
		top.Manifests[0].Annotations[AnnotationRefName] != "t1" ||
		top.Manifests[0].Digest.String() != res.IndexDigest {
		t.Fatalf("index.json = %s", raw)
	}

	// Read it back with go-containerregistry's layout reader.
	lp, err := layout.FromPath(ldir)
	if err != nil {
		t.Fatal(err)
	}
	outer, err := lp.ImageIndex()
	if err != nil {
		t.Fatal(err)
	}
	inner, err := outer.ImageIndex(top.Manifests[0].Digest)
	if err != nil {
		t.Fatal(err)
	}
	im, err := inner.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if im.Annotations["org.opencontainers.image.revision"] != "abc123" || im.Annotations["org.opencontainers.image.version"] != "v1.2.3" {
		t.Errorf("index annotations %v", im.Annotations)
	}
	if len(im.Manifests) != 3 {
		t.Fatalf("%d manifests, want 3", len(im.Manifests))
	}
	for i, d := range im.Manifests {
		want := arches[i]
		if d.MediaType != types.OCIManifestSchema1 || d.Platform == nil || d.Platform.OS != "linux" ||
			d.Platform.Architecture != want.GOARCH || d.Platform.Variant != want.Variant {
			t.Errorf("manifest %d: %s %+v, want linux/%s", i, d.MediaType, d.Platform, want)
		}
		if d.Digest.String() != res.Platforms[i].Digest {
			t.Errorf("manifest %d digest %s, result says %s", i, d.Digest, res.Platforms[i].Digest)
		}
		img, err := inner.Image(d.Digest)
		if err != nil {
			t.Fatal(err)
		}
		cf, err := img.ConfigFile()
		if err != nil {
			t.Fatal(err)
		}
		if cf.Architecture != want.GOARCH || cf.Variant != want.Variant || cf.OS != "linux" {
			t.Errorf("config platform %s/%s/%s", cf.OS, cf.Architecture, cf.Variant)
		}
		if !slices.Equal(cf.Config.Entrypoint, []string{"/usr/local/bin/meshcnictl"}) || cf.Config.User != "" {
			t.Errorf("entrypoint %v user %q", cf.Config.Entrypoint, cf.Config.User)
		}
		for k, v := range map[string]string{
			"org.opencontainers.image.source":   Source,
			"org.opencontainers.image.version":  "v1.2.3",
			"org.opencontainers.image.revision": "abc123",
		} {
			if cf.Config.Labels[k] != v {
				t.Errorf("label %s = %q, want %q", k, cf.Config.Labels[k], v)
			}
		}
		if mt, _ := img.MediaType(); mt != types.OCIManifestSchema1 {
			t.Errorf("manifest media type %s", mt)
		}
		files := layerFiles(t, img)
		wantFiles := map[string]string{
			"/opt/meshcni/bin/meshcni":                "meshcni",
			"/opt/meshcni/bin/meshcni-podget":         "meshcni-podget",
			"/usr/local/bin/meshcni-agent":            "meshcni-agent",
			"/usr/local/bin/meshcnictl":               "meshcnictl",
			"/usr/local/bin/meshcni-taint-controller": "meshcni-taint-controller",
		}
		// The image holds the node commands and nothing else that runs.
		for path, h := range files {
			if h.Typeflag == tar.TypeReg {
				if _, ok := wantFiles[path]; !ok {
					t.Errorf("%s: unexpected file %s in the product image", want, path)
				}
			}
		}
		for path, cmd := range wantFiles {
			h, ok := files[path]
			if !ok {
				t.Errorf("%s: %s missing; layer has %v", want, path, files)
				continue
			}
			if h.Mode&0o777 != 0o755 || h.Uid != 0 || h.Size != int64(len("binary "+cmd+" for "+want.String()+"\n")) {
				t.Errorf("%s: %s mode %o uid %d size %d", want, path, h.Mode, h.Uid, h.Size)
			}
		}
		if h, ok := files["/tmp"]; !ok || h.Mode&0o1777 != 0o1777 {
			t.Errorf("/tmp missing or not 1777: %+v", h)
		}
	}

	// manifest.json (docker load): the first architecture under the reference.
	var dm []struct {
		Config   string
		RepoTags []string
		Layers   []string
	}
	raw, _ = os.ReadFile(filepath.Join(ldir, "manifest.json"))
	if err := json.Unmarshal(raw, &dm); err != nil {
		t.Fatal(err)
	}
	if len(dm) != 1 || !slices.Equal(dm[0].RepoTags, []string{"meshcni.local/meshcni:t1"}) || len(dm[0].Layers) != 1 {
		t.Fatalf("manifest.json = %s", raw)
	}
	for _, p := range append([]string{dm[0].Config}, dm[0].Layers...) {
		if _, err := os.Stat(filepath.Join(ldir, p)); err != nil {
			t.Errorf("manifest.json names %s: %v", p, err)
		}
	}
}

func TestAssembleBadInput(t *testing.T) {
	arches := []Arch{{GOARCH: "amd64"}}
	bins := fakeBinaries(t, arches)
	dir := t.TempDir()
	out := filepath.Join(dir, "x.tar")
	if err := os.WriteFile(out, []byte("previous"), 0o644); err != nil {
		t.Fatal(err)
	}
	missing := map[Arch]map[string]string{arches[0]: {"meshcni": filepath.Join(dir, "nope")}}
	for name, o := range map[string]AssembleOptions{
		"no arch":        {Ref: "meshcni.local/meshcni:x", Tag: "x", Binaries: bins, Out: out},
		"no binaries":    {Ref: "meshcni.local/meshcni:x", Tag: "x", Arches: []Arch{{GOARCH: "arm64"}}, Binaries: bins, Out: out},
		"missing binary": {Ref: "meshcni.local/meshcni:x", Tag: "x", Arches: arches, Binaries: missing, Out: out},
	} {
		if _, err := Assemble(context.Background(), o); err == nil {
			t.Errorf("%s: no error", name)
		}
		if b, _ := os.ReadFile(out); string(b) != "previous" {
			t.Errorf("%s: previous archive changed", name)
		}
	}
}

func TestCommands(t *testing.T) {
	testutil.RequireBinary(t, "go")
	root, err := testbed.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	cmds, err := Commands(context.Background(), root)
	if err != nil {
		t.Fatal(err)
	}
	// Written out here, not taken from NodeCommands: the product image's commands.
	want := []string{"meshcni", "meshcni-agent", "meshcni-podget", "meshcni-taint-controller", "meshcnictl"}
	if !slices.Equal(cmds, want) {
		t.Errorf("Commands = %v, want exactly %v", cmds, want)
	}
	// A test or demo tool under cmd/ is refused, not shipped.
	mod := t.TempDir()
	for file, body := range map[string]string{
		"go.mod":                       "module example.com/m\n\ngo 1.24\n",
		"cmd/meshcni/main.go":          "package main\n\nfunc main() {}\n",
		"cmd/meshcni-proxysim/main.go": "package main\n\nfunc main() {}\n",
	} {
		p := filepath.Join(mod, file)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := Commands(context.Background(), mod); err == nil || !strings.Contains(err.Error(), "meshcni-proxysim") {
		t.Errorf("Commands with a test tool under cmd/: %v, want an error naming it", err)
	}
	if _, err := Commands(context.Background(), t.TempDir()); err == nil {
		t.Error("Commands outside a module: no error")
	}
}

// TestGoBuildStatic builds one real command and checks it is a static,
// stripped ELF for the requested architecture (cross-compiled when the host is not
// arm64).
func TestGoBuildStatic(t *testing.T) {
	testutil.RequireBinary(t, "go")
	root, err := testbed.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range []Arch{HostArch(), {GOARCH: "arm64"}} {
		if a.GOARCH == "arm64" && runtime.GOARCH == "arm64" {
			a = Arch{GOARCH: "amd64"}
		}
		dir := t.TempDir()
		if err := GoBuild(context.Background(), root, a, "v9.9.9-test", dir, []string{"meshcnictl"}); err != nil {
			t.Fatal(err)
		}
		f, err := elf.Open(filepath.Join(dir, "meshcnictl"))
		if err != nil {
			t.Fatal(err)
		}
		wantMachine := map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64}[a.GOARCH]
		if wantMachine != 0 && f.Machine != wantMachine {
			t.Errorf("%s: machine %v, want %v", a, f.Machine, wantMachine)
		}
		for _, p := range f.Progs {
			if p.Type == elf.PT_INTERP || p.Type == elf.PT_DYNAMIC {
				t.Errorf("%s: dynamic ELF (program header %v)", a, p.Type)
			}
		}
		if s := f.Section(".symtab"); s != nil {
			t.Errorf("%s: not stripped (.symtab present)", a)
		}
		f.Close()
	}
	if err := GoBuild(context.Background(), root, HostArch(), "x", t.TempDir(), []string{"does-not-exist"}); err == nil {
		t.Error("GoBuild of a missing command: no error")
	}
}

// TestDockerfileMatchesBuilder keeps the Dockerfile (for Docker users, not run in CI)
// in step with this builder: same flags, paths, entrypoint, PATH, labels, base, no
// USER, and the Go version of go.mod.
func TestDockerfileMatchesBuilder(t *testing.T) {
	root, err := testbed.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(root, "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	df := string(b)
	gomod, err := os.ReadFile(filepath.Join(root, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	var goVersion string
	for line := range strings.SplitSeq(string(gomod), "\n") {
		if v, ok := strings.CutPrefix(line, "go "); ok {
			goVersion = strings.TrimSpace(v)
		}
	}
	opts := imageOptions("meshcni.local/meshcni:dev", HostArch(), map[string]string{}, nil)
	want := []string{
		"ARG GO_VERSION=" + goVersion + "\n",
		"export CGO_ENABLED=0 GOOS=linux",
		`go build -trimpath -ldflags="-s -w -X main.version=$VERSION" -o /out/ ./cmd/...`,
		"mv /out/" + PluginCommand + " /out/" + HelperCommand + " /rootfs" + path.Dir(PluginPath) + "/;",
		"mv /out/* /rootfs" + BinDir + "/",
		"chmod 1777 /rootfs/tmp",
		"\nFROM scratch\n",
		"ENV " + opts.Env[0] + "\n",
		`ENTRYPOINT ["` + opts.Entrypoint[0] + `"]`,
	}
	for k, v := range Labels("${VERSION}", "${REVISION}") {
		want = append(want, k+`="`+v+`"`)
	}
	for _, w := range want {
		if !strings.Contains(df, w) {
			t.Errorf("Dockerfile lacks %q", w)
		}
	}
	for line := range strings.SplitSeq(df, "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "USER ") {
			t.Errorf("Dockerfile sets a user (%q); the image has none: the agent runs as root", line)
		}
	}
	if len(opts.Env) != 1 || len(opts.Entrypoint) != 1 {
		t.Errorf("builder env %v entrypoint %v: update this test and the Dockerfile", opts.Env, opts.Entrypoint)
	}
}
