// Command images builds meshcni's container image archive without Docker (see
// pkg/images): `make images` runs it. Flags:
//
//	--hub meshcni.local --tag dev --arch amd64,arm64 --out bin/images/meshcni-dev.tar
package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"slices"
	"syscall"

	"github.com/spf13/pflag"

	"github.com/meshcni/meshcni/internal/testkit/reporoot"
	"github.com/meshcni/meshcni/internal/tools/build/image"
	"github.com/meshcni/meshcni/pkg/flagenv"
)

func main() {
	fs := pflag.NewFlagSet("images", pflag.ExitOnError)
	hub := fs.String("hub", image.DefaultHub, "image hub (registry/namespace)")
	tag := fs.String("tag", image.DefaultTag, "image tag")
	arch := fs.String("arch", "", "comma-separated architectures (amd64, arm64, arm/v7, ppc64le, s390x, riscv64); empty: this machine's")
	out := fs.String("out", "", "archive path (default bin/images/meshcni-<tag>.tar)")
	version := fs.String("version", "", "version label and -X main.version (default: the tag)")
	revision := fs.String("revision", "", "revision label (default: git rev-parse HEAD)")
	_ = fs.Parse(flagenv.GoStyle(fs, os.Args[1:]))
	if fs.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "images: unexpected arguments %q\n", fs.Args())
		os.Exit(2)
	}
	arches, err := image.ParseArches(*arch)
	if err != nil {
		fmt.Fprintf(os.Stderr, "images: --arch: %v\n", err)
		os.Exit(2)
	}
	root, err := reporoot.Find()
	if err != nil {
		fmt.Fprintf(os.Stderr, "images: %v\n", err)
		os.Exit(1)
	}
	if *out == "" {
		*out = image.DefaultArchive(root, *tag)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	res, err := image.Build(ctx, image.Options{
		RepoRoot: root, Hub: *hub, Tag: *tag, Arches: arches,
		Version: *version, Revision: *revision, Out: *out,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, nil)),
	})
	if err != nil {
		fmt.Fprintf(os.Stderr, "images: %v\n", err)
		os.Exit(1)
	}
	fmt.Printf("%s  %s  %.1f MB  index %s  (%s)\n", res.Out, res.Ref, float64(res.ArchiveSize)/1e6, res.IndexDigest, res.Took.Round(1e7))
	for _, p := range res.Platforms {
		cmds := make([]string, 0, len(p.Commands))
		for c := range p.Commands {
			cmds = append(cmds, c)
		}
		slices.Sort(cmds)
		fmt.Printf("  linux/%s  %s  layer %.1f MB  %v\n", p.Arch, p.Digest, float64(p.Size)/1e6, cmds)
	}
}
