// Package flagenv is how meshcni's commands read their flags (spf13/pflag flag sets):
// every flag also has an environment variable (--cni-bin-dir is PREFIX_CNI_BIN_DIR; a
// flag on the command line beats its variable, which beats the default; the variable's
// name is appended to the flag's usage so --help shows it), and Go-style single-dash
// long flags (-kubeconfig) are still accepted.
package flagenv

import (
	"errors"
	"fmt"
	"strings"

	"github.com/spf13/pflag"
)

// Name returns the environment variable of a flag: prefix + the flag's name upper-cased
// with dashes as underscores.
func Name(prefix, flagName string) string {
	return prefix + strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}

// Bind sets every flag of fs whose variable getenv returns non-empty, and notes the
// variable in the flag's usage. Call it after defining the flags and before fs.Parse, so
// command-line flags override the environment. A list flag's variable is
// comma-separated, and the flag on the command line replaces its list rather than
// adding to it. Every bad value is reported, with the variable's name.
func Bind(fs *pflag.FlagSet, prefix string, getenv func(string) string) error {
	var errs []error
	fs.VisitAll(func(f *pflag.Flag) {
		env := Name(prefix, f.Name)
		f.Usage += " [$" + env + "]"
		if v := getenv(env); v != "" {
			if err := set(fs, f, v); err != nil {
				errs = append(errs, fmt.Errorf("%s=%q: %w", env, v, err))
			}
		}
	})
	return errors.Join(errs...)
}

// set gives f the value v from the environment. A list (pflag.SliceValue) is replaced
// without being marked as set, so that the command line's first --flag replaces it as
// it replaces a default.
func set(fs *pflag.FlagSet, f *pflag.Flag, v string) error {
	if sv, ok := f.Value.(pflag.SliceValue); ok {
		return sv.Replace(strings.Split(v, ","))
	}
	return fs.Set(f.Name, v)
}

// Parse binds the environment (Bind), then parses args (GoStyle first), refusing
// positional arguments: what a meshcni command with flags only does at start.
func Parse(fs *pflag.FlagSet, prefix string, args []string, getenv func(string) string) error {
	if err := Bind(fs, prefix, getenv); err != nil {
		return err
	}
	if err := fs.Parse(GoStyle(fs, args)); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	return nil
}

// GoStyle returns args with every Go-style single-dash long flag that fs defines
// (-kubeconfig, -kubeconfig=PATH, -keep-on-exit) spelled as pflag reads it
// (--kubeconfig...), so command lines written for Go's flag package keep working.
// Shorthands (-h, -n NS), flag values, positional arguments and everything after "--"
// stay as they are.
func GoStyle(fs *pflag.FlagSet, args []string) []string {
	out := make([]string, 0, len(args))
	for i := 0; i < len(args); i++ {
		s := args[i]
		if s == "--" {
			return append(out, args[i:]...)
		}
		if len(s) < 2 || s[0] != '-' {
			out = append(out, s)
			continue
		}
		if s[1] != '-' && isLong(fs, s[1:]) {
			s = "-" + s
		}
		out = append(out, s)
		if takesNext(fs, s) && i+1 < len(args) {
			i++
			out = append(out, args[i])
		}
	}
	return out
}

// isLong says whether arg (a token without its leading dash) names a long flag of fs
// rather than shorthands: a one-letter name is a shorthand when fs has one.
func isLong(fs *pflag.FlagSet, arg string) bool {
	name, _, _ := strings.Cut(arg, "=")
	if fs.Lookup(name) == nil {
		return false
	}
	return len(name) > 1 || fs.ShorthandLookup(name) == nil
}

// takesNext says whether the flag token s (--name, -x, -xyz) leaves its value to the
// next argument, as pflag reads it.
func takesNext(fs *pflag.FlagSet, s string) bool {
	if name, ok := strings.CutPrefix(s, "--"); ok {
		if strings.Contains(name, "=") {
			return false
		}
		f := fs.Lookup(name)
		return f != nil && f.NoOptDefVal == ""
	}
	for i := 1; i < len(s); i++ {
		f := fs.ShorthandLookup(s[i : i+1])
		if f == nil {
			return false
		}
		if f.NoOptDefVal == "" {
			return i == len(s)-1 // -n NS; -nNS holds its value
		}
	}
	return false
}
