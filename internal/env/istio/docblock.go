package istio

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"time"

	"github.com/meshcni/meshcni/internal/env/testbed"
)

// DocText returns the lines of the fenced block whose info string is "<lang> <tag>"
// in a Markdown document, and the document line number of the first. A tag with no
// block, with two, or an unclosed block is an error.
func DocText(doc []byte, lang, tag string) (lines []string, first int, err error) {
	found, in := false, false
	for i, line := range strings.Split(string(doc), "\n") {
		trimmed := strings.TrimSpace(line)
		if !in {
			if info, ok := strings.CutPrefix(trimmed, "```"); ok && strings.Join(strings.Fields(info), " ") == lang+" "+tag {
				if found {
					return nil, 0, fmt.Errorf("line %d: a second block tagged %q", i+1, tag)
				}
				found, in, first = true, true, i+2
			}
			continue
		}
		if trimmed == "```" {
			in = false
			continue
		}
		lines = append(lines, line)
	}
	switch {
	case !found:
		return nil, 0, fmt.Errorf("no block tagged %q", tag)
	case in:
		return nil, 0, fmt.Errorf("the block tagged %q is not closed", tag)
	}
	return lines, first, nil
}

// DocBlock returns the commands of the fenced block whose info string is
// "sh <tag>" in a Markdown document (docs/migration.md tags the procedures the
// migration tests run that way): one argv per line, "\" continuations joined,
// comments and blank lines skipped. The commands are run without a shell, so a
// line holding shell syntax (quotes, $, pipes, redirections, ;, &, globs) is an
// error, as is a tag with no block or with two.
func DocBlock(doc []byte, tag string) ([][]string, error) {
	lines, first, err := DocText(doc, "sh", tag)
	if err != nil {
		return nil, err
	}
	var (
		cmds [][]string
		cont string
	)
	for i, line := range lines {
		trimmed := strings.TrimSpace(line)
		if trimmed == "" || strings.HasPrefix(trimmed, "#") {
			continue
		}
		if before, ok := strings.CutSuffix(trimmed, `\`); ok {
			cont += before + " "
			continue
		}
		full := cont + trimmed
		cont = ""
		if j := strings.IndexAny(full, "'\"`$|&;<>*?(){}"); j >= 0 {
			return nil, fmt.Errorf("line %d: %q: %q is shell syntax; the tests run these commands without a shell", first+i, full, full[j])
		}
		cmds = append(cmds, strings.Fields(full))
	}
	if len(cmds) == 0 {
		return nil, fmt.Errorf("the block tagged %q holds no command", tag)
	}
	return cmds, nil
}

// Substitute replaces the arguments that are keys of subst (the doc's chart and
// values-file names) with their values, in a copy of argv.
func Substitute(argv []string, subst map[string]string) []string {
	out := make([]string, len(argv))
	for i, a := range argv {
		if v, ok := subst[a]; ok {
			a = v
		}
		out[i] = a
	}
	return out
}

// DocStep is one command of a doc block as run on the test bed.
type DocStep struct {
	Argv   []string
	Took   time.Duration
	Output string
}

// RunDocBlock runs the commands of the block tagged tag in the Markdown file doc on
// the test bed, in order: helm (hack/helm's) and kubectl with the test bed's
// kubeconfig, each argument substituted (Substitute). after, when not nil, runs
// after each command (the test bed's adaptations, e.g. CNIHostNetwork after the
// istio-cni chart is installed). It stops at the first failure.
func RunDocBlock(ctx context.Context, o Options, doc, tag string, subst map[string]string, after func(argv []string) error) ([]DocStep, error) {
	o.defaults()
	raw, err := os.ReadFile(doc)
	if err != nil {
		return nil, err
	}
	cmds, err := DocBlock(raw, tag)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", doc, err)
	}
	helm := ""
	var steps []DocStep
	for _, argv := range cmds {
		argv = Substitute(argv, subst)
		bin := argv[0]
		switch bin {
		case "helm":
			if helm == "" {
				r, err := newRunner(ctx, nil, o)
				if err != nil {
					return steps, err
				}
				helm = r.helm
			}
			bin = helm
		case "kubectl":
		default:
			return steps, fmt.Errorf("%s block %q: %q: only helm and kubectl run here", doc, tag, argv[0])
		}
		began := time.Now()
		cmd := exec.CommandContext(ctx, bin, argv[1:]...)
		cmd.Env = append(os.Environ(), "KUBECONFIG="+testbed.KubeconfigPath())
		out, err := cmd.CombinedOutput()
		step := DocStep{Argv: argv, Took: time.Since(began), Output: strings.TrimSpace(string(out))}
		steps = append(steps, step)
		o.Log.Info("doc "+tag, "cmd", strings.Join(argv, " "), "took", step.Took.Round(time.Millisecond))
		if err != nil {
			return steps, fmt.Errorf("%s: %w: %s", strings.Join(argv, " "), err, step.Output)
		}
		if after != nil {
			if err := after(argv); err != nil {
				return steps, err
			}
		}
	}
	return steps, nil
}
