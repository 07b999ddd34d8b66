package plugin

import (
	"reflect"
	"strings"
	"testing"
)

// jsonKeys lists the JSON keys of a struct type, nested objects dotted, embedded
// structs flattened (a field shadows an embedded one of the same name).
func jsonKeys(t reflect.Type, prefix string, out map[string]bool) {
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if f.Anonymous && name == "" {
			jsonKeys(f.Type, prefix, out)
			continue
		}
		if name == "" || name == "-" {
			continue
		}
		if f.Type.Kind() == reflect.Struct {
			delete(out, prefix+name)
			jsonKeys(f.Type, prefix+name+".", out)
			continue
		}
		out[prefix+name] = true
	}
}

// TestConfigKeysComplete fails when ParseConfig reads a key ConfigKeys does not
// document, or ConfigKeys documents one it does not read.
func TestConfigKeysComplete(t *testing.T) {
	read := map[string]bool{}
	jsonKeys(reflect.TypeOf(rawConfig{}), "", read)
	// The CNI spec's own keys of every plugin configuration are the spec's to document.
	for _, k := range []string{"cniVersion", "name", "capabilities", "prevResult"} {
		if !read[k] {
			t.Errorf("rawConfig no longer reads the CNI key %s", k)
		}
		delete(read, k)
	}
	documented := map[string]bool{}
	for _, k := range ConfigKeys {
		if documented[k.Key] {
			t.Errorf("%s documented twice", k.Key)
		}
		documented[k.Key] = true
		if !read[k.Key] {
			t.Errorf("%s is documented but not read by ParseConfig", k.Key)
		}
	}
	for k := range read {
		if !documented[k] {
			t.Errorf("ParseConfig reads %s, which ConfigKeys does not document", k)
		}
	}
}
