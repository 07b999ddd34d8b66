package output

import (
	"bytes"
	"testing"
)

type result struct {
	TypeMeta `json:",inline"`
	PodName  string `json:"podName"`
	Count    int    `json:"count,omitempty"`
}

func TestWrite(t *testing.T) {
	r := result{TypeMeta: Meta("Thing"), PodName: "app/web"}
	for _, tc := range []struct {
		f    Format
		want string
	}{
		{JSON, "{\n  \"apiVersion\": \"meshcni.io/v1alpha1\",\n  \"kind\": \"Thing\",\n  \"podName\": \"app/web\"\n}\n"},
		{YAML, "apiVersion: meshcni.io/v1alpha1\nkind: Thing\npodName: app/web\n"},
	} {
		var b bytes.Buffer
		if err := Write(&b, tc.f, r); err != nil {
			t.Fatal(err)
		}
		if b.String() != tc.want {
			t.Errorf("Write %s:\n%s\nwant:\n%s", tc.f, b.String(), tc.want)
		}
	}
	if err := Write(&bytes.Buffer{}, Text, r); err == nil {
		t.Error("Write text: no error")
	}
}

func TestParseFormat(t *testing.T) {
	for in, ok := range map[string]bool{"text": true, "json": true, "yaml": true, "JSON": false, "wide": false, "": false} {
		f, err := ParseFormat(in)
		if ok != (err == nil) || ok && string(f) != in {
			t.Errorf("ParseFormat(%q) = %q, %v", in, f, err)
		}
	}
}
