// Package image builds meshcni's container image without Docker: one image,
// "<hub>/meshcni:<tag>", holding every node command of the module (cmd/*, exactly
// NodeCommands) as a static binary (CGO_ENABLED=0, -trimpath) on top of scratch, for
// one or more architectures. Test and demo tools have their own images
// (BuildProxysim).
//
// Layout inside the image:
//
//	/usr/local/bin/<command>           every other node command
//	/opt/meshcni/bin/meshcni           the CNI plugin (the agent's default --plugin-binary)
//	/opt/meshcni/bin/meshcni-podget    its API helper, installed next to it by the agent
//	/tmp                         01777
//
// The entrypoint is /usr/local/bin/meshcnictl, so the image stands in for Istio's
// proxy-init image: the injector passes `istio-iptables …` as arguments (the chart
// names the agent's and the taint controller's commands). The agent has to run as root (it
// writes into the host's CNI directories), so the image sets no user; the other
// commands can run as any UID (the demo runs meshcnictl validate as 1337).
//
// The output is one OCI image-layout tarball (oci-layout, index.json, blobs/sha256/…)
// whose index.json points at an OCI image index with one manifest per architecture,
// annotated with io.containerd.image.name (what `ctr images import` names the image
// by) and org.opencontainers.image.ref.name. It also carries a Docker-style
// manifest.json for the first architecture, so `docker load` of any Docker version
// accepts it. Builds are reproducible: the same binaries give the same digests.
package image

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"

	"github.com/meshcni/meshcni/internal/tools/build/ociimage"
	"github.com/meshcni/meshcni/pkg/podget"
)

// Fixed names and paths of the image.
const (
	// Name is the image's repository name under the hub.
	Name = "meshcni"
	// DefaultHub is the hub of locally built images (no registry: they are imported).
	DefaultHub = "meshcni.local"
	// DefaultTag is the tag of a development build.
	DefaultTag = "dev"
	// BinDir holds the commands inside the image.
	BinDir = "/usr/local/bin"
	// PluginCommand is the CNI plugin's command; PluginPath its place in the image
	// (meshcni-agent's default --plugin-binary).
	PluginCommand = "meshcni"
	PluginPath    = "/opt/meshcni/bin/meshcni"
	// HelperCommand is the plugin's API helper, next to it.
	HelperCommand = podget.HelperName
	// AgentCommand is the node agent (the chart's DaemonSet command).
	AgentCommand = "meshcni-agent"
	// EntrypointCommand is the image's entrypoint: meshcnictl (istio-iptables,
	// validate, rules, …), Istio's proxy-init image's role.
	EntrypointCommand = "meshcnictl"
	// Source is the source repository recorded in the labels.
	Source = "https://github.com/meshcni/meshcni"
)

// NodeCommands are the commands of the product image, and its only ones: what runs on
// a node or in a pod (the plugin, its API helper, the agent, meshcnictl — also the
// validation init container — and the taint controller). Commands fails when cmd/
// holds anything else, so a test or demo tool cannot slip into the privileged image;
// those live under hack/ and internal/ (the stand-in proxy has its own image,
// BuildProxysim).
var NodeCommands = []string{PluginCommand, HelperCommand, AgentCommand, "meshcnictl", "meshcni-taint-controller"}

// Arch is a target architecture: GOARCH and, for arm, the GOARM level that is also
// the OCI platform variant.
type Arch struct {
	GOARCH  string
	Variant string // "v7" for arm; empty otherwise
}

func (a Arch) String() string {
	if a.Variant != "" {
		return a.GOARCH + "/" + a.Variant
	}
	return a.GOARCH
}

// supported lists the architectures the build accepts (Kubernetes' own set).
var supported = map[string]Arch{
	"amd64":   {GOARCH: "amd64"},
	"arm64":   {GOARCH: "arm64"},
	"arm":     {GOARCH: "arm", Variant: "v7"},
	"arm/v7":  {GOARCH: "arm", Variant: "v7"},
	"ppc64le": {GOARCH: "ppc64le"},
	"s390x":   {GOARCH: "s390x"},
	"riscv64": {GOARCH: "riscv64"},
}

// HostArch is the architecture of this machine.
func HostArch() Arch {
	if a, ok := supported[runtime.GOARCH]; ok {
		return a
	}
	return Arch{GOARCH: runtime.GOARCH}
}

// ParseArches parses a comma-separated list such as "amd64,arm64" (empty: the host's
// architecture). Duplicates and unknown names are errors.
func ParseArches(s string) ([]Arch, error) {
	if strings.TrimSpace(s) == "" {
		return []Arch{HostArch()}, nil
	}
	var out []Arch
	seen := map[Arch]bool{}
	for f := range strings.SplitSeq(s, ",") {
		f = strings.TrimSpace(f)
		a, ok := supported[strings.TrimPrefix(f, "linux/")]
		if !ok {
			keys := make([]string, 0, len(supported))
			for k := range supported {
				keys = append(keys, k)
			}
			slices.Sort(keys)
			return nil, fmt.Errorf("architecture %q: want one of %s", f, strings.Join(keys, ", "))
		}
		if seen[a] {
			return nil, fmt.Errorf("architecture %q given twice", f)
		}
		seen[a] = true
		out = append(out, a)
	}
	return out, nil
}

// Ref is the image reference for hub and tag, validated.
func Ref(hub, tag string) (string, error) {
	ref := hub + "/" + Name + ":" + tag
	if _, err := name.NewTag(ref, name.StrictValidation); err != nil {
		return "", fmt.Errorf("image reference %q (hub %q, tag %q): %w", ref, hub, tag, err)
	}
	return ref, nil
}

// PathInImage is where a command's binary lives in the image.
func PathInImage(command string) string {
	switch command {
	case PluginCommand:
		return PluginPath
	case HelperCommand:
		return path.Join(path.Dir(PluginPath), HelperCommand)
	}
	return path.Join(BinDir, command)
}

// Options describe one build.
type Options struct {
	// RepoRoot is the module's root (the go command runs there).
	RepoRoot string
	// Hub and Tag name the image: <Hub>/meshcni:<Tag>. Defaults DefaultHub, DefaultTag.
	Hub, Tag string
	// Arches to build; the host's when empty.
	Arches []Arch
	// Version and Revision go into the labels (org.opencontainers.image.version,
	// .revision) and the binaries (-X main.version). Version defaults to Tag,
	// Revision to `git rev-parse HEAD` (+ "-dirty" for a modified tree), or
	// "unknown" outside git.
	Version, Revision string
	// Out is the archive to write (atomically).
	Out string
	// WorkDir receives the binaries (<WorkDir>/<goarch>[-<variant>]/); a temporary
	// directory removed at the end when empty.
	WorkDir string
	// Logger receives progress; slog.Default() when nil.
	Logger *slog.Logger
}

// Platform is one architecture's image in the index.
type Platform struct {
	Arch     Arch
	Digest   string // manifest digest
	Size     int64  // compressed layer bytes
	Commands map[string]int64
}

// Result is a finished build.
type Result struct {
	Ref         string
	Out         string
	ArchiveSize int64
	IndexDigest string
	Version     string
	Revision    string
	Platforms   []Platform
	Took        time.Duration
}

// Build compiles every command for each architecture and writes the image archive.
// The archive is assembled once per content: Build copies it from CacheRoot when the
// same binaries, reference, version and revision were assembled before (the bytes are
// the same either way).
func Build(ctx context.Context, opts Options) (*Result, error) {
	began := time.Now()
	log := opts.Logger
	if log == nil {
		log = slog.Default()
	}
	if opts.RepoRoot == "" {
		return nil, errors.New("images: RepoRoot is required")
	}
	if opts.Out == "" {
		return nil, errors.New("images: Out is required")
	}
	if opts.Hub == "" {
		opts.Hub = DefaultHub
	}
	if opts.Tag == "" {
		opts.Tag = DefaultTag
	}
	ref, err := Ref(opts.Hub, opts.Tag)
	if err != nil {
		return nil, err
	}
	if len(opts.Arches) == 0 {
		opts.Arches = []Arch{HostArch()}
	}
	if opts.Version == "" {
		opts.Version = opts.Tag
	}
	if opts.Revision == "" {
		opts.Revision = gitRevision(ctx, opts.RepoRoot)
	}
	cmds, err := Commands(ctx, opts.RepoRoot)
	if err != nil {
		return nil, err
	}
	work := opts.WorkDir
	if work == "" {
		if work, err = os.MkdirTemp("", "meshcni-images-"); err != nil {
			return nil, err
		}
		defer os.RemoveAll(work)
	}
	bins := map[Arch]map[string]string{}
	for _, a := range opts.Arches {
		dir := filepath.Join(work, strings.ReplaceAll(a.String(), "/", "-"))
		t := time.Now()
		if err := GoBuild(ctx, opts.RepoRoot, a, opts.Version, dir, cmds); err != nil {
			return nil, err
		}
		log.Info("built binaries", "arch", a.String(), "commands", len(cmds), "took", time.Since(t).Round(time.Millisecond))
		m := map[string]string{}
		for _, c := range cmds {
			m[c] = filepath.Join(dir, c)
		}
		bins[a] = m
	}
	t := time.Now()
	res, cached, err := assembleCached(ctx, AssembleOptions{
		Ref: ref, Tag: opts.Tag, Version: opts.Version, Revision: opts.Revision,
		Arches: opts.Arches, Binaries: bins, Out: opts.Out,
	})
	if err != nil {
		return nil, err
	}
	log.Info("archive assembled", "cached", cached, "took", time.Since(t).Round(time.Millisecond))
	res.Took = time.Since(began)
	return res, nil
}

// Commands lists the module's cmd/* main packages by name (sorted) and checks that
// they are exactly NodeCommands.
func Commands(ctx context.Context, repoRoot string) ([]string, error) {
	cmd := exec.CommandContext(ctx, "go", "list", "-f", "{{.Name}} {{.Dir}}", "./cmd/...")
	cmd.Dir = repoRoot
	cmd.Env = append(os.Environ(), "GOOS=linux", "CGO_ENABLED=0")
	out, err := cmd.Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return nil, fmt.Errorf("go list ./cmd/...: %w: %s", err, strings.TrimSpace(string(ee.Stderr)))
		}
		return nil, fmt.Errorf("go list ./cmd/...: %w", err)
	}
	var cmds []string
	for line := range strings.SplitSeq(strings.TrimSpace(string(out)), "\n") {
		pkgName, dir, ok := strings.Cut(line, " ")
		if !ok || pkgName != "main" {
			continue
		}
		// Only direct children of cmd/ are commands (cmd/x/internal/... is not).
		if filepath.Base(filepath.Dir(dir)) != "cmd" {
			continue
		}
		cmds = append(cmds, filepath.Base(dir))
	}
	slices.Sort(cmds)
	want := slices.Sorted(slices.Values(NodeCommands))
	if !slices.Equal(cmds, want) {
		return nil, fmt.Errorf("%s/cmd holds %v; the product image takes exactly the node commands %v (test and demo tools belong under hack/ or internal/)", repoRoot, cmds, want)
	}
	return cmds, nil
}

// GoBuild compiles the named cmd/* commands for linux/arch into dir, static and
// reproducible: CGO_ENABLED=0, -trimpath, stripped, -X main.version=version.
func GoBuild(ctx context.Context, repoRoot string, a Arch, version, dir string, commands []string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	args := []string{"build", "-trimpath", "-ldflags=-s -w -X main.version=" + version, "-o", dir + "/"}
	for _, c := range commands {
		args = append(args, "./cmd/"+c)
	}
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = repoRoot
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+a.GOARCH)
	if a.GOARCH == "arm" {
		cmd.Env = append(cmd.Env, "GOARM="+strings.TrimPrefix(a.Variant, "v"))
	}
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build for linux/%s: %w: %s", a, err, strings.TrimSpace(string(out)))
	}
	return nil
}

func gitRevision(ctx context.Context, dir string) string {
	out, err := exec.CommandContext(ctx, "git", "-C", dir, "rev-parse", "HEAD").Output()
	if err != nil {
		return "unknown"
	}
	rev := strings.TrimSpace(string(out))
	// Only tracked files count: untracked files of others in progress do not make
	// the tree dirty for this purpose.
	if err := exec.CommandContext(ctx, "git", "-C", dir, "diff", "--quiet", "HEAD", "--").Run(); err != nil {
		rev += "-dirty"
	}
	return rev
}

// imageOptions is the ociimage description of one architecture's image.
func imageOptions(ref string, a Arch, bins map[string]string, labels map[string]string) ociimage.Options {
	files := map[string]string{}
	for c, p := range bins {
		files[PathInImage(c)] = p
	}
	return ociimage.Options{
		Ref:        ref,
		Files:      files,
		Dirs:       map[string]os.FileMode{"/tmp": os.ModeSticky | 0o777},
		Entrypoint: []string{PathInImage(EntrypointCommand)},
		Env:        []string{"PATH=" + BinDir + ":" + path.Dir(PluginPath)},
		Labels:     labels,
		Arch:       a.GOARCH,
	}
}

// DefaultArchive is where `make images` writes the archive for tag:
// <repoRoot>/bin/images/meshcni-<tag>.tar.
func DefaultArchive(repoRoot, tag string) string {
	return filepath.Join(repoRoot, "bin", "images", Name+"-"+tag+".tar")
}
