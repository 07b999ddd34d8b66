package agentsock

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"testing"
	"time"
)

// coldEncodeEnv makes the test binary a child that encodes one "cmd" line, the
// way its value names (appendCommandLine or encoding/json), prints how long that
// took in nanoseconds and exits: the first and only encode of a fresh process, as
// in the CNI plugin.
const coldEncodeEnv = "MESHCNI_AGENTSOCK_COLD_ENCODE"

func TestMain(m *testing.M) {
	if v := os.Getenv(coldEncodeEnv); v != "" {
		os.Exit(coldEncode(v))
	}
	os.Exit(m.Run())
}

// benchResult is a typical ADD's result: a meshed pod with eBPF acceleration.
func benchResult() *CommandResult {
	return &CommandResult{Command: CommandAdd, Result: ResultSuccess, Seconds: 0.0042, Pod: Pod{Namespace: "default", Name: "web-7d9f8b6c4-x2lqp"},
		ContainerID: "0f3c9e2a7b1d4c6e8f0a2b4c6d8e0f1a3b5c7d9e1f2a4b6c8d0e2f4a6b8c0d2e", EBPF: &PodEBPF{NetnsCookie: 4099, ProxyUID: 1337, PodUID: "9b2e4c1a-7f3d-4e5b-8a6c-2d1f0e9b8a7c"}}
}

// encoders are the two ways of writing a "cmd" line.
var encoders = map[string]func(*CommandResult) []byte{
	"handwritten": func(r *CommandResult) []byte { return appendCommandLine(make([]byte, 0, 256), r) },
	"encoding-json": func(r *CommandResult) []byte {
		b, err := json.Marshal(&Message{V: Version, Kind: KindCommand, Cmd: r})
		if err != nil {
			panic(err)
		}
		return append(b, '\n')
	},
}

func coldEncode(variant string) int {
	enc, ok := encoders[variant]
	if !ok {
		fmt.Fprintf(os.Stderr, "no encoder %q\n", variant)
		return 2
	}
	// The plugin has decoded its JSON configuration before it reports: encoding/json
	// is loaded, only the encoders of Message's types are not built yet.
	var conf struct {
		CNIVersion string `json:"cniVersion"`
	}
	if err := json.Unmarshal([]byte(`{"cniVersion":"1.0.0"}`), &conf); err != nil {
		return 1
	}
	r := benchResult()
	t0 := time.Now()
	line := enc(r)
	d := time.Since(t0)
	if len(line) == 0 {
		return 1
	}
	fmt.Println(d.Nanoseconds())
	return 0
}

// BenchmarkCommandLine compares the hand-written "cmd" line encoder with
// encoding/json: warm (b.Loop in one process) and cold (the first encode of a
// fresh process, the plugin's case: per iteration the test binary runs once per
// variant, interleaved; the child times the encode alone). Reported for cold:
// p50-µs per variant; ns/op is the whole child process and means little.
func BenchmarkCommandLine(b *testing.B) {
	names := []string{"handwritten", "encoding-json"}
	for _, name := range names {
		b.Run("warm/"+name, func(b *testing.B) {
			r := benchResult()
			for b.Loop() {
				_ = encoders[name](r)
			}
		})
	}
	b.Run("cold", func(b *testing.B) {
		self, err := os.Executable()
		if err != nil {
			b.Fatal(err)
		}
		ds := map[string][]time.Duration{}
		for b.Loop() {
			for _, name := range names {
				ds[name] = append(ds[name], runColdEncode(b, self, name))
			}
		}
		for _, name := range names {
			slices.Sort(ds[name])
			b.ReportMetric(float64(ds[name][len(ds[name])/2].Nanoseconds())/1000, name+"-p50-µs")
		}
	})
}

func runColdEncode(b *testing.B, self, variant string) time.Duration {
	b.Helper()
	cmd := exec.Command(self)
	cmd.Env = append(os.Environ(), coldEncodeEnv+"="+variant)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		b.Fatalf("%s child: %v: %s", variant, err, errb.Bytes())
	}
	ns, err := strconv.ParseInt(string(bytes.TrimSpace(out.Bytes())), 10, 64)
	if err != nil {
		b.Fatalf("%s child output %q: %v", variant, out.Bytes(), err)
	}
	return time.Duration(ns)
}
