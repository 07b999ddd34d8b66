package main

import (
	"errors"
	"strings"

	"github.com/spf13/cobra"
)

func init() { subcommands = append(subcommands, newIstioIptablesCmd) }

// rulesIgnoredBools and rulesIgnoredStrings are the istio-iptables flags the rules
// commands accept and ignore: logging, and the mode flags istio-iptables (the command
// below) turns into the choice of command. Flags that would change where or how
// rules go (--network-namespace, --force-legacy-iptables) are not among them: an
// unknown flag fails rather than act on the wrong namespace or backend.
var (
	rulesIgnoredBools = []ignoredBool{
		{"cleanup-only", ""}, {"dry-run", "n"}, {"log_as_json", ""}, {"iptables-trace-logging", ""},
		{"restore-format", ""}, {"native-nftables", ""}, {"reconcile", ""}, {"force-apply", ""},
	}
	rulesIgnoredStrings = []string{"log_output_level", "iptables-version", "output-paths"}
)

// errReported: a nested run already printed its error.
var errReported = errors.New("reported")

// newIstioIptablesCmd is pilot-agent's `istio-iptables` under its own name, so the
// meshcni image (whose entrypoint is meshcnictl) can stand in for Istio's proxy-init
// image unchanged: the injector renders `args: [istio-iptables, -p, 15001, ...]` for
// the istio-validation (CNI mode) and istio-init containers alike.
func newIstioIptablesCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "istio-iptables [istio-iptables flags]",
		Short: "Serve Istio's istio-iptables command line with meshcni: validate, apply, clean or render the redirect",
		Long: `istio-iptables takes the arguments Istio's injector renders for its proxy-init image
and does what pilot-agent's istio-iptables does with them, through meshcni:

  --run-validation   meshcnictl validate (exit 126 when the redirect is missing)
  --cleanup-only     meshcnictl rules clean
  --dry-run, -n      meshcnictl rules render
  otherwise          meshcnictl rules apply (the privileged istio-init fallback)

Point the injector's proxy-init image at the meshcni image and its istio-validation
containers run meshcni's validation with Istio's own arguments.`,
		DisableFlagParsing: true,
		RunE: func(cmd *cobra.Command, args []string) error {
			if code := run(append(istioIptablesMode(args), args...)); code != 0 {
				return &exitError{code: code, err: errReported}
			}
			return nil
		},
	}
}

// istioIptablesMode picks the meshcnictl command for an istio-iptables command line.
func istioIptablesMode(args []string) []string {
	set := func(names ...string) bool {
		for _, a := range args {
			if a == "--" {
				return false
			}
			for _, n := range names {
				v, ok := strings.CutPrefix(a, n)
				if ok && (v == "" || v == "=true" || v == "=1") {
					return true
				}
			}
		}
		return false
	}
	switch {
	case set("--run-validation"):
		return []string{"validate"}
	case set("--cleanup-only"):
		return []string{"rules", "clean"}
	case set("--dry-run", "-n"):
		return []string{"rules", "render"}
	}
	return []string{"rules", "apply"}
}
