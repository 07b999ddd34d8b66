package layout

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"strings"
	"testing"

	"github.com/meshcni/meshcni/internal/testkit/reporoot"
)

// Test tiers by file name (docs/testing.md, "Test tiers"): a plain _test.go file is
// unit tests only; *_root_test.go needs root and network namespaces but no cluster;
// *_testbed_test.go needs the test bed.
const (
	rootSuffix    = "_root_test.go"
	testbedSuffix = "_testbed_test.go"
)

// tierCall is a gate whose call fixes a test file's tier.
type tierCall struct {
	pkg, fn string
	// allowed are the file name endings a file calling it may have.
	allowed []string
}

var tierCalls = []tierCall{
	{"testbed", "Shared", []string{testbedSuffix}},
	{"testbed", "API", []string{testbedSuffix}},
	{"testutil", "RequireRoot", []string{rootSuffix, testbedSuffix}},
}

// gatesCalled returns the package-qualified gates of tierCalls that the file calls.
func gatesCalled(f *ast.File) []tierCall {
	var got []tierCall
	seen := map[int]bool{}
	ast.Inspect(f, func(n ast.Node) bool {
		call, ok := n.(*ast.CallExpr)
		if !ok {
			return true
		}
		sel, ok := call.Fun.(*ast.SelectorExpr)
		if !ok {
			return true
		}
		x, ok := sel.X.(*ast.Ident)
		if !ok {
			return true
		}
		for i, g := range tierCalls {
			if x.Name == g.pkg && sel.Sel.Name == g.fn && !seen[i] {
				seen[i] = true
				got = append(got, g)
			}
		}
		return true
	})
	return got
}

// tierViolations lists what is wrong with a test file's name given the gates it calls.
func tierViolations(name string, calls []tierCall) []string {
	var out []string
	for _, g := range calls {
		ok := false
		for _, s := range g.allowed {
			ok = ok || strings.HasSuffix(name, s)
		}
		if !ok {
			out = append(out, g.pkg+"."+g.fn+" called: the file must end in "+strings.Join(g.allowed, " or "))
		}
	}
	return out
}

// TestTierViolations: the rule itself, on names and calls written out by hand.
func TestTierViolations(t *testing.T) {
	shared, root := tierCalls[0], tierCalls[2]
	tests := []struct {
		name  string
		calls []tierCall
		bad   int
	}{
		{"x_test.go", nil, 0},
		{"x_test.go", []tierCall{root}, 1},
		{"x_root_test.go", []tierCall{root}, 0},
		{"x_testbed_test.go", []tierCall{root}, 0},
		{"x_root_test.go", []tierCall{shared}, 1},
		{"x_test.go", []tierCall{shared, root}, 2},
		{"x_testbed_test.go", []tierCall{shared, root}, 0},
		{"testbed_test.go", []tierCall{shared}, 1},
	}
	for _, tt := range tests {
		if got := tierViolations(tt.name, tt.calls); len(got) != tt.bad {
			t.Errorf("%s with %d gates: %d violations %v, want %d", tt.name, len(tt.calls), len(got), got, tt.bad)
		}
	}
}

// TestTestTiersByFileName: every test file in the module is named for the tier its
// gates say. What it cannot see: a file that reaches the test bed or root only
// through a helper of its package.
func TestTestTiersByFileName(t *testing.T) {
	root, err := reporoot.Find()
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	checked := 0
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if n := d.Name(); path != root && (strings.HasPrefix(n, ".") || n == "testdata" || n == "bin" || n == "dist") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		checked++
		rel, _ := filepath.Rel(root, path)
		for _, v := range tierViolations(d.Name(), gatesCalled(f)) {
			t.Errorf("%s: %s", rel, v)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if checked < 100 {
		t.Fatalf("checked %d test files, want the module's (over 100)", checked)
	}
}
