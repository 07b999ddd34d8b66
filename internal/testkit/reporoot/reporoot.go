// Package reporoot finds the meshcni module's root directory, for the tools and tests
// that build or read files of the repository (it imports nothing heavy, so a command
// using it stays free of the Kubernetes client).
package reporoot

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
)

// Find walks up from the working directory to the go.mod of
// github.com/meshcni/meshcni and returns its directory.
func Find() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		b, err := os.ReadFile(filepath.Join(dir, "go.mod"))
		if err == nil && strings.Contains(string(b), "module github.com/meshcni/meshcni\n") {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("no meshcni go.mod above the working directory")
		}
		dir = parent
	}
}
