package deploy_test

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/restmapper"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
)

// dryRunNamespace is where the matrix is rendered for the dry runs (ours alone).
const dryRunNamespace = "meshcni-deploy-dryrun"

// notInstalled are kinds whose CRD the test bed does not have: skipped by name, counted.
var notInstalled = map[string]bool{"ServiceMonitor": true}

type dryRunner struct {
	dyn    dynamic.Interface
	mapper meta.RESTMapper
}

// serverSideApply sends o with server-side apply (forced, strict field validation) and
// the given dry-run setting and field manager.
func serverSideApply(ctx context.Context, dyn dynamic.Interface, mapper meta.RESTMapper, o *unstructured.Unstructured, opts metav1.PatchOptions) (*unstructured.Unstructured, error) {
	gvk := o.GroupVersionKind()
	m, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	if err != nil {
		return nil, err
	}
	data, err := o.MarshalJSON()
	if err != nil {
		return nil, err
	}
	var ri dynamic.ResourceInterface = dyn.Resource(m.Resource)
	if m.Scope.Name() == meta.RESTScopeNameNamespace {
		ri = dyn.Resource(m.Resource).Namespace(o.GetNamespace())
	}
	force := true
	opts.Force, opts.FieldValidation = &force, "Strict"
	return ri.Patch(ctx, o.GetName(), types.ApplyPatchType, data, opts)
}

// apply sends o with server-side apply, dry run and strict field validation: the API
// server decodes, defaults, validates and admits it, and stores nothing.
func (d *dryRunner) apply(ctx context.Context, o *unstructured.Unstructured) error {
	got, err := serverSideApply(ctx, d.dyn, d.mapper, o, metav1.PatchOptions{DryRun: []string{metav1.DryRunAll}, FieldManager: "meshcni-deploy-test"})
	if err != nil {
		return err
	}
	if got.GetName() != o.GetName() || got.GetKind() != o.GetKind() {
		return errors.New("the server answered with another object: " + got.GetKind() + " " + got.GetName())
	}
	return nil
}

// TestServerDryRun sends every object of every matrix case, and of the published
// manifests, to the real test-bed API server (kube-apiserver with its admission chain)
// as a server-side dry-run apply with strict field validation.
func TestServerDryRun(t *testing.T) {
	testutil.RequireRoot(t)
	if _, err := testbed.Lookup(); err != nil {
		if errors.Is(err, testbed.ErrNotBuilt) {
			testutil.Missing(t, "%v", err)
		}
		t.Fatal(err)
	}
	helmBinary(t) // skip or fail before starting anything
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	began := time.Now()
	tb, err := testbed.Start(ctx, testbed.Options{APIOnly: true})
	if errors.Is(err, testbed.ErrRunning) {
		tb, err = testbed.Attach(ctx) // a shared test bed (hack/testbed up) is running
	}
	if err != nil {
		t.Fatalf("test bed: %v", err)
	}
	t.Cleanup(func() { _ = tb.Stop(context.Background()) })
	t.Logf("API server up in %s (%s after the lock)", time.Since(began).Round(time.Millisecond), tb.StartupTime.Round(time.Millisecond))

	dyn, err := dynamic.NewForConfig(tb.RESTConfig)
	if err != nil {
		t.Fatal(err)
	}
	// Multus' CRD, so the NetworkAttachmentDefinition of provider multus is validated too.
	installCRD(ctx, t, dyn, "testdata/network-attachment-definition-crd.yaml")
	dc, err := discovery.NewDiscoveryClientForConfig(tb.RESTConfig)
	if err != nil {
		t.Fatal(err)
	}
	groups, err := restmapper.GetAPIGroupResources(dc)
	if err != nil {
		t.Fatal(err)
	}
	d := &dryRunner{dyn: dyn, mapper: restmapper.NewDiscoveryRESTMapper(groups)}

	// Namespaced objects need their namespace to exist, even in a dry run.
	for _, ns := range []string{dryRunNamespace, namespace} {
		createNamespace(ctx, t, tb, ns)
	}

	t.Run("strict validation is on", func(t *testing.T) {
		// The negative control: a misspelt field is refused, so a pass below means something.
		_, objs := render(t, dryRunNamespace, nil)
		for _, o := range objs {
			if o.GetKind() == "DaemonSet" {
				if err := unstructured.SetNestedField(o.Object, true, "spec", "template", "spec", "hostNetwrok"); err != nil {
					t.Fatal(err)
				}
				err := d.apply(ctx, o)
				if err == nil || !strings.Contains(err.Error(), "hostNetwrok") || !strings.Contains(err.Error(), "not declared in schema") {
					t.Fatalf("a DaemonSet with a misspelt field: %v; want it refused", err)
				}
				return
			}
		}
		t.Fatal("no DaemonSet rendered")
	})

	check := func(t *testing.T, objs []*unstructured.Unstructured, wantSkipped int) {
		t.Helper()
		applied, skipped := 0, 0
		for _, o := range objs {
			if notInstalled[o.GetKind()] {
				skipped++
				continue
			}
			if err := d.apply(ctx, o); err != nil {
				t.Errorf("%s %s/%s refused: %v", o.GetKind(), o.GetNamespace(), o.GetName(), err)
				continue
			}
			applied++
		}
		if skipped != wantSkipped || applied < 5 {
			t.Errorf("%d objects accepted, %d skipped (want %d skipped)", applied, skipped, wantSkipped)
		}
	}
	for _, tc := range matrix() {
		t.Run(tc.name, func(t *testing.T) {
			_, objs := render(t, dryRunNamespace, tc.values)
			want := 0
			if tc.name == "servicemonitor" {
				want = 1
			}
			check(t, objs, want)
		})
	}
	for _, m := range manifestSets {
		t.Run(m.file, func(t *testing.T) {
			b, err := os.ReadFile(m.file)
			if err != nil {
				t.Fatal(err)
			}
			objs, err := parseObjects(string(b))
			if err != nil {
				t.Fatal(err)
			}
			if objs[0].GetKind() != "Namespace" {
				t.Fatalf("%s does not start with its Namespace", m.file)
			}
			check(t, objs, 0)
		})
	}
}

// createNamespace creates ns (privileged, as docs/install.md says) unless it exists. It
// deletes only its own dry-run namespace at the end: on a shared test bed
// (hack/testbed up) someone may install into meshcni-system meanwhile; a test bed this
// test started is torn down with everything in it anyway.
func createNamespace(ctx context.Context, t *testing.T, tb *testbed.Testbed, ns string) {
	t.Helper()
	obj := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns, Labels: map[string]string{"pod-security.kubernetes.io/enforce": "privileged"}}}
	_, err := tb.Client.CoreV1().Namespaces().Create(ctx, obj, metav1.CreateOptions{})
	switch {
	case apierrors.IsAlreadyExists(err):
		return
	case err != nil:
		t.Fatalf("create namespace %s: %v", ns, err)
	}
	if ns == dryRunNamespace {
		t.Cleanup(func() { _ = tb.Client.CoreV1().Namespaces().Delete(context.Background(), ns, metav1.DeleteOptions{}) })
	}
}

var crdResource = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

// installCRD creates the CRD in file unless it exists (then it is left as found; one this
// test created is deleted at the end) and waits until it is established.
func installCRD(ctx context.Context, t *testing.T, dyn dynamic.Interface, file string) {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	objs, err := parseObjects(string(b))
	if err != nil || len(objs) != 1 {
		t.Fatalf("%s: %v (%d objects)", file, err, len(objs))
	}
	crds := dyn.Resource(crdResource)
	name := objs[0].GetName()
	switch _, err := crds.Create(ctx, objs[0], metav1.CreateOptions{}); {
	case apierrors.IsAlreadyExists(err):
	case err != nil:
		t.Fatalf("create CRD %s: %v", name, err)
	default:
		t.Cleanup(func() { _ = crds.Delete(context.Background(), name, metav1.DeleteOptions{}) })
	}
	for {
		got, err := crds.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatalf("CRD %s: %v", name, err)
		}
		conds, _, _ := unstructured.NestedSlice(got.Object, "status", "conditions")
		for _, c := range conds {
			if m, _ := c.(map[string]any); m["type"] == "Established" && m["status"] == "True" {
				return
			}
		}
		select {
		case <-ctx.Done():
			t.Fatalf("CRD %s not established: %v", name, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}
