package flagenv

import (
	"flag"
	"io"
	"strings"
	"testing"
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
			fs := flag.NewFlagSet("t", flag.ContinueOnError)
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

func TestParseRefusesArguments(t *testing.T) {
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.String("a", "", "")
	if err := Parse(fs, "P_", []string{"--a", "x", "stray"}, func(string) string { return "" }); err == nil || !strings.Contains(err.Error(), "stray") {
		t.Fatalf("Parse with a positional argument: %v, want an error naming it", err)
	}
	if err := Parse(fs, "P_", []string{"--nope"}, func(string) string { return "" }); err == nil {
		t.Fatal("Parse with an unknown flag: want an error")
	}
}
