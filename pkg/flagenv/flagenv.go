// Package flagenv gives every flag of a flag.FlagSet an environment variable: --cni-bin-dir
// is PREFIX_CNI_BIN_DIR. A flag on the command line beats its variable, which beats the
// default. The variable's name is appended to the flag's usage so --help shows it.
package flagenv

import (
	"errors"
	"flag"
	"fmt"
	"strings"
)

// Name returns the environment variable of a flag: prefix + the flag's name upper-cased
// with dashes as underscores.
func Name(prefix, flagName string) string {
	return prefix + strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}

// Bind sets every flag of fs whose variable getenv returns non-empty, and notes the
// variable in the flag's usage. Call it after defining the flags and before fs.Parse, so
// command-line flags override the environment. Every bad value is reported, with the
// variable's name.
func Bind(fs *flag.FlagSet, prefix string, getenv func(string) string) error {
	var errs []error
	fs.VisitAll(func(f *flag.Flag) {
		env := Name(prefix, f.Name)
		f.Usage += " [$" + env + "]"
		if v := getenv(env); v != "" {
			if err := fs.Set(f.Name, v); err != nil {
				errs = append(errs, fmt.Errorf("%s=%q: %w", env, v, err))
			}
		}
	})
	return errors.Join(errs...)
}

// Parse binds the environment (Bind), then parses args, refusing positional
// arguments: what a meshcni command with flags only does at start.
func Parse(fs *flag.FlagSet, prefix string, args []string, getenv func(string) string) error {
	if err := Bind(fs, prefix, getenv); err != nil {
		return err
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	return nil
}
