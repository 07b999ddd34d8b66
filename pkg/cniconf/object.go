package cniconf

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
)

// member is one key of a JSON object, its value kept verbatim.
type member struct {
	key   string
	value json.RawMessage
}

// object is a JSON object that keeps its keys' order and its values' bytes.
type object []member

func parseObject(data []byte) (object, error) {
	dec := json.NewDecoder(bytes.NewReader(data))
	tok, err := dec.Token()
	if err != nil {
		return nil, fmt.Errorf("parse JSON: %w", err)
	}
	if d, ok := tok.(json.Delim); !ok || d != '{' {
		return nil, errors.New("parse JSON: not an object")
	}
	var obj object
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, fmt.Errorf("parse JSON: %w", err)
		}
		key, ok := tok.(string)
		if !ok {
			return nil, fmt.Errorf("parse JSON: key %v is not a string", tok)
		}
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return nil, fmt.Errorf("parse JSON: value of %q: %w", key, err)
		}
		obj = append(obj, member{key: key, value: raw})
	}
	if _, err := dec.Token(); err != nil {
		return nil, fmt.Errorf("parse JSON: %w", err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, errors.New("parse JSON: data after the top-level object")
	}
	return obj, nil
}

func (o object) get(key string) (json.RawMessage, bool) {
	for i := len(o) - 1; i >= 0; i-- { // the last duplicate wins, as in encoding/json
		if o[i].key == key {
			return o[i].value, true
		}
	}
	return nil, false
}

// set replaces every member named key by one (at the first one's place), or appends it.
func (o object) set(key string, value json.RawMessage) object {
	out := o[:0:0]
	done := false
	for _, m := range o {
		if m.key != key {
			out = append(out, m)
			continue
		}
		if !done {
			out = append(out, member{key: key, value: value})
			done = true
		}
	}
	if !done {
		out = append(out, member{key: key, value: value})
	}
	return out
}

// marshal encodes the object indented by two spaces, ending with a newline.
func (o object) marshal() ([]byte, error) {
	var buf bytes.Buffer
	buf.WriteByte('{')
	for i, m := range o {
		if i > 0 {
			buf.WriteByte(',')
		}
		k, err := json.Marshal(m.key)
		if err != nil {
			return nil, err
		}
		buf.Write(k)
		buf.WriteByte(':')
		buf.Write(m.value)
	}
	buf.WriteByte('}')
	return indent(buf.Bytes())
}

func indent(data []byte) ([]byte, error) {
	var out bytes.Buffer
	if err := json.Indent(&out, data, "", "  "); err != nil {
		return nil, fmt.Errorf("indent JSON: %w", err)
	}
	out.WriteByte('\n')
	return out.Bytes(), nil
}

// marshalArray encodes raw values as a JSON array.
func marshalArray(values []json.RawMessage) json.RawMessage {
	var buf bytes.Buffer
	buf.WriteByte('[')
	for i, v := range values {
		if i > 0 {
			buf.WriteByte(',')
		}
		buf.Write(v)
	}
	buf.WriteByte(']')
	return buf.Bytes()
}
