// Command release builds meshcni's release artifacts into dist/<version> (see
// internal/tools/release and docs/release.md): `make release VERSION=x.y.z` runs it. Flags:
//
//	--version 1.2.0 --hub ghcr.io/meshcni --arch amd64,arm64 --out dist/1.2.0
package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"github.com/spf13/pflag"

	"github.com/meshcni/meshcni/internal/env/demo"
	"github.com/meshcni/meshcni/internal/testkit/reporoot"
	"github.com/meshcni/meshcni/internal/tools/build/image"
	"github.com/meshcni/meshcni/internal/tools/release"
)

func main() {
	fs := pflag.NewFlagSet("release", pflag.ExitOnError)
	version := fs.String("version", "", "release version MAJOR.MINOR.PATCH[-PRERELEASE] (required)")
	hub := fs.String("hub", release.DefaultHub, "image registry/namespace; the packaged chart's default hub")
	arch := fs.String("arch", "amd64,arm64", "comma-separated image architectures")
	out := fs.String("out", "", "release directory, must not exist (default dist/<version>)")
	_ = fs.Parse(os.Args[1:])
	if fs.NArg() > 0 {
		fail(2, "unexpected arguments %q", fs.Args())
	}
	if _, err := release.ParseVersion(*version); err != nil {
		fail(2, "--version: %v", err)
	}
	arches, err := image.ParseArches(*arch)
	if err != nil {
		fail(2, "--arch: %v", err)
	}
	root, err := reporoot.Find()
	if err != nil {
		fail(1, "%v", err)
	}
	if *out == "" {
		*out = filepath.Join(root, "dist", *version)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	helm, err := demo.HelmPath(ctx, root)
	if err != nil {
		fail(1, "helm: %v", err)
	}
	res, err := release.Build(ctx, release.Options{
		RepoRoot: root, Version: *version, Hub: *hub, Arches: arches, Out: *out, Helm: helm,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, nil)),
	})
	if err != nil {
		fail(1, "%v", err)
	}
	fmt.Printf("meshcni %s in %s (%s)\n  image %s\n", *version, res.Out, res.Took.Round(1e7), res.Pinned())
	for _, f := range res.Files {
		fmt.Printf("  %s\n", f)
	}
}

func fail(code int, format string, args ...any) {
	fmt.Fprintf(os.Stderr, "release: "+format+"\n", args...)
	os.Exit(code)
}
