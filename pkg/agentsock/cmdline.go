package agentsock

import (
	"encoding/json"
	"math"
	"strconv"
)

// appendCommandLine appends the line of a "cmd" message carrying r: the bytes
// json.Marshal(&Message{V: Version, Kind: KindCommand, Cmd: r}) and a newline,
// written without encoding/json's reflection, which in the plugin's fresh process
// would build the encoders of Message's types at every start for the one
// message every CNI command sends (BenchmarkCommandLine: ≈ 13 µs against ≈ 200 µs
// cold; docs/performance.md).
func appendCommandLine(b []byte, r *CommandResult) []byte {
	b = append(b, `{"v":`...)
	b = strconv.AppendInt(b, Version, 10)
	b = append(b, `,"kind":"`+KindCommand+`","cmd":{"command":`...)
	b = appendJSONString(b, r.Command)
	b = append(b, `,"result":`...)
	b = appendJSONString(b, r.Result)
	b = append(b, `,"duration_seconds":`...)
	b = appendJSONFloat(b, r.Seconds)
	b = append(b, `,"pod":{`...)
	if r.Pod.Namespace != "" {
		b = append(b, `"namespace":`...)
		b = appendJSONString(b, r.Pod.Namespace)
	}
	if r.Pod.Name != "" {
		if r.Pod.Namespace != "" {
			b = append(b, ',')
		}
		b = append(b, `"name":`...)
		b = appendJSONString(b, r.Pod.Name)
	}
	b = append(b, '}')
	if r.ErrorMsg != "" {
		b = append(b, `,"error":`...)
		b = appendJSONString(b, r.ErrorMsg)
	}
	if r.ContainerID != "" {
		b = append(b, `,"container_id":`...)
		b = appendJSONString(b, r.ContainerID)
	}
	if e := r.EBPF; e != nil {
		b = append(b, `,"ebpf":{"netns_cookie":`...)
		b = strconv.AppendUint(b, e.NetnsCookie, 10)
		if e.Mode != "" {
			b = append(b, `,"mode":`...)
			b = appendJSONString(b, e.Mode)
		}
		b = append(b, `,"proxy_uid":`...)
		b = strconv.AppendUint(b, uint64(e.ProxyUID), 10)
		if e.PodUID != "" {
			b = append(b, `,"pod_uid":`...)
			b = appendJSONString(b, e.PodUID)
		}
		b = append(b, '}')
	}
	if sb := r.Sandbox; sb != nil {
		b = appendSandbox(b, sb)
	}
	return append(b, "}}\n"...)
}

// appendSandbox appends the "sandbox" member as encoding/json writes it.
func appendSandbox(b []byte, sb *Sandbox) []byte {
	b = append(b, `,"sandbox":{`...)
	if sb.PodUID != "" {
		b = append(b, `"pod_uid":`...)
		b = appendJSONString(b, sb.PodUID)
		b = append(b, ',')
	}
	b = append(b, `"decision":`...)
	b = appendJSONString(b, sb.Decision)
	if sb.Reason != "" {
		b = append(b, `,"reason":`...)
		b = appendJSONString(b, sb.Reason)
	}
	if sb.Netns != "" {
		b = append(b, `,"netns":`...)
		b = appendJSONString(b, sb.Netns)
	}
	b = append(b, `,"netns_dev":`...)
	b = strconv.AppendUint(b, sb.NetnsDev, 10)
	b = append(b, `,"netns_inode":`...)
	b = strconv.AppendUint(b, sb.NetnsInode, 10)
	b = append(b, `,"netns_cookie":`...)
	b = strconv.AppendUint(b, sb.NetnsCookie, 10)
	return append(b, '}')
}

// appendJSONString appends s as encoding/json writes it. Printable ASCII other than
// the characters json escapes (", \\, and the HTML-sensitive <, >, &) is copied;
// any other string is left to encoding/json, whose string encoder needs no reflection
// over struct types.
func appendJSONString(b []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c > 0x7e || c == '"' || c == '\\' || c == '<' || c == '>' || c == '&' {
			q, err := json.Marshal(s)
			if err != nil { // cannot happen: every string encodes
				return append(b, `""`...)
			}
			return append(b, q...)
		}
	}
	b = append(b, '"')
	b = append(b, s...)
	return append(b, '"')
}

// appendJSONFloat appends f as encoding/json writes a float64 (ES6 number format).
// f must be finite (a duration's seconds always are).
func appendJSONFloat(b []byte, f float64) []byte {
	format := byte('f')
	if a := math.Abs(f); a != 0 && (a < 1e-6 || a >= 1e21) {
		format = 'e'
	}
	b = strconv.AppendFloat(b, f, format, -1, 64)
	if format == 'e' {
		// clean up e-09 to e-9
		if n := len(b); n >= 4 && b[n-4] == 'e' && b[n-3] == '-' && b[n-2] == '0' {
			b[n-2] = b[n-1]
			b = b[:n-1]
		}
	}
	return b
}
