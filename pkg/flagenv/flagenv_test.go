package flagenv

import (
	"errors"
	"io"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"
)

func TestBind(t *testing.T) {
	for _, tc := range []struct {
		name    string
		env     map[string]string
		args    []string
		want    string
		wantN   int
		wantErr string
	}{
		{name: "default", want: "d", wantN: 1},
		{name: "env", env: map[string]string{"P_SOME_DIR": "e", "P_N": "7"}, want: "e", wantN: 7},
		{name: "flag beats env", env: map[string]string{"P_SOME_DIR": "e"}, args: []string{"--some-dir", "f"}, want: "f", wantN: 1},
		{name: "bad env value", env: map[string]string{"P_N": "x"}, wantErr: `P_N="x"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fs := pflag.NewFlagSet("t", pflag.ContinueOnError)
			fs.SetOutput(io.Discard)
			s := fs.String("some-dir", "d", "a dir")
			n := fs.Int("n", 1, "a number")
			err := Bind(fs, "P_", func(k string) string { return tc.env[k] })
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("Bind error = %v, want one naming %s", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if err := fs.Parse(tc.args); err != nil {
				t.Fatal(err)
			}
			if *s != tc.want || *n != tc.wantN {
				t.Fatalf("got %q %d, want %q %d", *s, *n, tc.want, tc.wantN)
			}
			if u := fs.Lookup("some-dir").Usage; !strings.HasSuffix(u, "[$P_SOME_DIR]") {
				t.Fatalf("usage %q does not name the variable", u)
			}
		})
	}
}

// TestParseEnvBinding: each kind of flag the commands define, from its MESHCNI_*
// variable, under every spelling of the flag that beats it.
func TestParseEnvBinding(t *testing.T) {
	type values struct {
		dir   string
		on    bool
		n     int
		wait  time.Duration
		items []string
	}
	defaults := values{dir: "/d", on: true, n: 1, wait: time.Second}
	for _, tc := range []struct {
		name    string
		env     map[string]string
		args    []string
		want    values
		wantErr []string // parts of the error
	}{
		{name: "defaults", want: defaults},
		{name: "every kind from the environment",
			env:  map[string]string{"MESHCNI_CNI_BIN_DIR": "/e", "MESHCNI_CHAINED": "false", "MESHCNI_CONFLICT_THRESHOLD": "0x10", "MESHCNI_GRACE_PERIOD": "1m30s", "MESHCNI_NETNS_DIR": "/a,/b"},
			want: values{dir: "/e", on: false, n: 16, wait: 90 * time.Second, items: []string{"/a", "/b"}}},
		{name: "other prefixes are not read", env: map[string]string{"CNI_BIN_DIR": "/x", "ISTIO_CNI_BIN_DIR": "/y"}, want: defaults},
		{name: "flag beats env: --flag value", env: map[string]string{"MESHCNI_CNI_BIN_DIR": "/e"}, args: []string{"--cni-bin-dir", "/f"},
			want: values{dir: "/f", on: true, n: 1, wait: time.Second}},
		{name: "flag beats env: --flag=value", env: map[string]string{"MESHCNI_GRACE_PERIOD": "5s"}, args: []string{"--grace-period=7s"},
			want: values{dir: "/d", on: true, n: 1, wait: 7 * time.Second}},
		{name: "flag beats env: Go-style -flag=value", env: map[string]string{"MESHCNI_CHAINED": "false"}, args: []string{"-chained=true"}, want: defaults},
		{name: "flag beats env: Go-style -flag value", env: map[string]string{"MESHCNI_CONFLICT_THRESHOLD": "9"}, args: []string{"-conflict-threshold", "3"},
			want: values{dir: "/d", on: true, n: 3, wait: time.Second}},
		{name: "flag beats env: shorthand", env: map[string]string{"MESHCNI_CNI_BIN_DIR": "/e"}, args: []string{"-b", "/s"},
			want: values{dir: "/s", on: true, n: 1, wait: time.Second}},
		{name: "a bool flag alone is true", env: map[string]string{"MESHCNI_CHAINED": "false"}, args: []string{"--chained"}, want: defaults},
		{name: "a slice flag replaces the env's list", env: map[string]string{"MESHCNI_NETNS_DIR": "/a,/b"}, args: []string{"--netns-dir", "/c"},
			want: values{dir: "/d", on: true, n: 1, wait: time.Second, items: []string{"/c"}}},
		{name: "empty env is unset", env: map[string]string{"MESHCNI_CNI_BIN_DIR": ""}, want: defaults},
		{name: "bad bool env", env: map[string]string{"MESHCNI_CHAINED": "yes please"}, wantErr: []string{`MESHCNI_CHAINED="yes please"`, "invalid syntax"}},
		{name: "bad int env", env: map[string]string{"MESHCNI_CONFLICT_THRESHOLD": "five"}, wantErr: []string{`MESHCNI_CONFLICT_THRESHOLD="five"`}},
		{name: "bad duration env", env: map[string]string{"MESHCNI_GRACE_PERIOD": "30"}, wantErr: []string{`MESHCNI_GRACE_PERIOD="30"`, "missing unit"}},
		{name: "every bad env named", env: map[string]string{"MESHCNI_GRACE_PERIOD": "30", "MESHCNI_CHAINED": "maybe"},
			wantErr: []string{"MESHCNI_GRACE_PERIOD", "MESHCNI_CHAINED"}},
		{name: "bad flag value", args: []string{"--grace-period", "soon"}, wantErr: []string{`"soon"`, "--grace-period"}},
		{name: "unknown flag", args: []string{"--nope"}, wantErr: []string{"unknown flag: --nope"}},
		{name: "unknown Go-style flag", args: []string{"-nope"}, wantErr: []string{"unknown shorthand flag: 'n' in -nope"}},
		{name: "positional argument", args: []string{"--chained=false", "install"}, wantErr: []string{`unexpected arguments: ["install"]`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got values
			fs := pflag.NewFlagSet("t", pflag.ContinueOnError)
			fs.SetOutput(io.Discard)
			fs.StringVarP(&got.dir, "cni-bin-dir", "b", "/d", "dir")
			fs.BoolVar(&got.on, "chained", true, "on")
			fs.IntVar(&got.n, "conflict-threshold", 1, "n")
			fs.DurationVar(&got.wait, "grace-period", time.Second, "wait")
			fs.StringSliceVar(&got.items, "netns-dir", nil, "dirs")
			err := Parse(fs, "MESHCNI_", tc.args, func(k string) string { return tc.env[k] })
			if tc.wantErr != nil {
				for _, w := range tc.wantErr {
					if err == nil || !strings.Contains(err.Error(), w) {
						t.Fatalf("error %v, want one containing %q", err, w)
					}
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got.dir != tc.want.dir || got.on != tc.want.on || got.n != tc.want.n || got.wait != tc.want.wait || !slices.Equal(got.items, tc.want.items) {
				t.Fatalf("got %+v, want %+v", got, tc.want)
			}
			fs.VisitAll(func(f *pflag.Flag) {
				if want := "[$" + Name("MESHCNI_", f.Name) + "]"; !strings.HasSuffix(f.Usage, want) {
					t.Errorf("--%s usage %q, want it to end with %s", f.Name, f.Usage, want)
				}
			})
		})
	}
}

func TestName(t *testing.T) {
	for flag, want := range map[string]string{
		"cni-bin-dir":                "MESHCNI_CNI_BIN_DIR",
		"kubeconfig":                 "MESHCNI_KUBECONFIG",
		"repair-init-container-name": "MESHCNI_REPAIR_INIT_CONTAINER_NAME",
		"dns-listen-v4":              "MESHCNI_DNS_LISTEN_V4",
	} {
		if got := Name("MESHCNI_", flag); got != want {
			t.Errorf("Name(%q) = %q, want %q", flag, got, want)
		}
	}
}

func TestParseRefusesArguments(t *testing.T) {
	fs := pflag.NewFlagSet("t", pflag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.String("a", "", "")
	if err := Parse(fs, "P_", []string{"--a", "x", "stray"}, func(string) string { return "" }); err == nil || !strings.Contains(err.Error(), "stray") {
		t.Fatalf("Parse with a positional argument: %v, want an error naming it", err)
	}
	if err := Parse(fs, "P_", []string{"--nope"}, func(string) string { return "" }); err == nil {
		t.Fatal("Parse with an unknown flag: want an error")
	}
}

func TestParseHelp(t *testing.T) {
	for _, arg := range []string{"--help", "-h", "-help"} {
		fs := pflag.NewFlagSet("t", pflag.ContinueOnError)
		var out strings.Builder
		fs.SetOutput(&out)
		fs.String("kubeconfig", "", "kubeconfig file")
		if err := Parse(fs, "P_", []string{arg}, func(string) string { return "" }); !errors.Is(err, pflag.ErrHelp) {
			t.Errorf("%s: %v, want pflag.ErrHelp", arg, err)
		}
		if !strings.Contains(out.String(), "--kubeconfig string   kubeconfig file [$P_KUBECONFIG]") {
			t.Errorf("%s: usage %q lacks the flag with its variable", arg, out.String())
		}
	}
}

func TestGoStyle(t *testing.T) {
	fs := pflag.NewFlagSet("t", pflag.ContinueOnError)
	fs.String("kubeconfig", "", "")
	fs.StringP("namespace", "n", "", "")
	fs.Bool("keep-on-exit", false, "")
	fs.BoolP("verbose", "v", false, "")
	fs.String("x", "", "") // a one-letter long flag without a shorthand
	fs.StringP("backend", "b", "", "")
	for _, tc := range []struct {
		name string
		args []string
		want []string
	}{
		{"empty", nil, []string{}},
		{"pflag spellings unchanged", []string{"--kubeconfig", "/k", "--namespace=a", "-n", "b", "-nb", "-vn", "c", "--keep-on-exit"},
			[]string{"--kubeconfig", "/k", "--namespace=a", "-n", "b", "-nb", "-vn", "c", "--keep-on-exit"}},
		{"Go-style long flags", []string{"-kubeconfig", "/k", "-kubeconfig=/k", "-keep-on-exit", "-keep-on-exit=false", "-x", "1"},
			[]string{"--kubeconfig", "/k", "--kubeconfig=/k", "--keep-on-exit", "--keep-on-exit=false", "--x", "1"}},
		{"values that look like flags stay values", []string{"--kubeconfig", "-namespace", "-kubeconfig", "-keep-on-exit", "-n", "-kubeconfig", "-b", "-x"},
			[]string{"--kubeconfig", "-namespace", "--kubeconfig", "-keep-on-exit", "-n", "-kubeconfig", "-b", "-x"}},
		{"a bool flag takes no value", []string{"-keep-on-exit", "-kubeconfig", "/k"}, []string{"--keep-on-exit", "--kubeconfig", "/k"}},
		{"shorthands and unknown flags unchanged", []string{"-n", "a", "-v", "-h", "-help", "-nope", "-"}, []string{"-n", "a", "-v", "-h", "-help", "-nope", "-"}},
		{"positional arguments unchanged", []string{"ns/pod", "-kubeconfig", "/k", "run"}, []string{"ns/pod", "--kubeconfig", "/k", "run"}},
		{"nothing after --", []string{"-kubeconfig", "/k", "--", "-kubeconfig", "-n"}, []string{"--kubeconfig", "/k", "--", "-kubeconfig", "-n"}},
		{"a value the last argument", []string{"-kubeconfig"}, []string{"--kubeconfig"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := GoStyle(fs, tc.args); !slices.Equal(got, tc.want) {
				t.Fatalf("GoStyle(%q) = %q, want %q", tc.args, got, tc.want)
			}
		})
	}
}
