// Package output writes meshcnictl's results as text, JSON or YAML. JSON and YAML
// carry a Kubernetes-style envelope (apiVersion, kind) and the result's camelCase
// field names.
package output

import (
	"encoding/json"
	"fmt"
	"io"

	"sigs.k8s.io/yaml"
)

// APIVersion of every result meshcnictl prints as JSON or YAML.
const APIVersion = "meshcni.io/v1alpha1"

// Format is an output format (-o).
type Format string

// Formats.
const (
	Text Format = "text"
	JSON Format = "json"
	YAML Format = "yaml"
)

// ParseFormat parses -o.
func ParseFormat(s string) (Format, error) {
	switch f := Format(s); f {
	case Text, JSON, YAML:
		return f, nil
	}
	return "", fmt.Errorf("-o %q: want text, json or yaml", s)
}

// TypeMeta is the envelope of a result, embedded (inline) in it.
type TypeMeta struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
}

// Meta returns the envelope of a result of kind.
func Meta(kind string) TypeMeta { return TypeMeta{APIVersion: APIVersion, Kind: kind} }

// Write writes v as JSON (indented) or YAML (from its JSON field names).
func Write(out io.Writer, f Format, v any) error {
	data, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return fmt.Errorf("encode the result: %w", err)
	}
	switch f {
	case JSON:
		data = append(data, '\n')
	case YAML:
		if data, err = yaml.JSONToYAML(data); err != nil {
			return fmt.Errorf("encode the result as YAML: %w", err)
		}
	default:
		return fmt.Errorf("format %q is not structured", f)
	}
	_, err = out.Write(data)
	return err
}
