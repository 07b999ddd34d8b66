package agent

import (
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/meshcni/meshcni/pkg/fileutil"
)

func TestParseKeepMode(t *testing.T) {
	for in, want := range map[string]KeepMode{"auto": KeepAuto, "always": KeepAlways, "never": KeepNever, "true": KeepAlways, "false": KeepNever} {
		if got, err := ParseKeepMode(in); err != nil || got != want {
			t.Errorf("ParseKeepMode(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, in := range []string{"", "yes", "Auto", "1"} {
		if _, err := ParseKeepMode(in); err == nil || !strings.Contains(err.Error(), "want auto, always or never") {
			t.Errorf("ParseKeepMode(%q): %v", in, err)
		}
	}
	for _, tc := range []struct {
		args []string
		env  string
		want KeepMode
	}{
		{nil, "", KeepAuto}, // the default
		{[]string{"--keep-on-exit"}, "", KeepAlways},
		{[]string{"--keep-on-exit=never"}, "always", KeepNever},
		{nil, "never", KeepNever},
		{nil, "true", KeepAlways},
	} {
		c, err := ParseFlags(tc.args, func(k string) string {
			if k == "MESHCNI_KEEP_ON_EXIT" {
				return tc.env
			}
			return ""
		}, &strings.Builder{})
		if err != nil || c.KeepOnExit != tc.want {
			t.Errorf("args %q env %q: %v, %v; want %q", tc.args, tc.env, c, err, tc.want)
		}
	}
}

var dsResource = schema.GroupResource{Group: "apps", Resource: "daemonsets"}

func daemonSet(deleting bool) *appsv1.DaemonSet {
	ds := &appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Namespace: "meshcni-system", Name: "meshcni-agent"}}
	if deleting {
		now := metav1.Now()
		ds.DeletionTimestamp = &now
		ds.Finalizers = []string{"foregroundDeletion"}
	}
	return ds
}

// TestDecideExit: keep only while the DaemonSet exists and is not being deleted.
func TestDecideExit(t *testing.T) {
	for _, tc := range []struct {
		name           string
		ds             *appsv1.DaemonSet
		err            error
		keep, final    bool
		reasonContains string
	}{
		{"exists (upgrade, restart, eviction)", daemonSet(false), nil, true, true, "the next agent takes over"},
		{"being deleted (foreground)", daemonSet(true), nil, false, true, "being deleted"},
		{"gone (helm uninstall)", nil, apierrors.NewNotFound(dsResource, "meshcni-agent"), false, true, "gone"},
		{"RBAC removed", nil, apierrors.NewForbidden(dsResource, "meshcni-agent", errors.New("no")), false, true, "RBAC removed"},
		{"service account removed", nil, apierrors.NewUnauthorized("token"), false, true, "RBAC removed"},
		{"API server timeout", nil, apierrors.NewServerTimeout(dsResource, "get", 1), false, false, "cannot read"},
		{"connection refused", nil, fmt.Errorf("dial tcp 10.0.0.1:443: connect: connection refused"), false, false, "cannot read"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			keep, final, why := DecideExit(tc.ds, tc.err)
			if keep != tc.keep || final != tc.final || !strings.Contains(why, tc.reasonContains) {
				t.Errorf("DecideExit = keep %v final %v %q; want keep %v final %v, a reason with %q", keep, final, why, tc.keep, tc.final, tc.reasonContains)
			}
		})
	}
}

// TestKeepOnExitAsks: auto asks the API server, retries what is not final, then
// removes; always and never do not ask.
func TestKeepOnExitAsks(t *testing.T) {
	for _, tc := range []struct {
		name     string
		mode     KeepMode
		objects  []runtime.Object
		failures int // GETs that fail with a timeout before the real answer
		keep     bool
		gets     int
	}{
		{"auto, DaemonSet there", KeepAuto, []runtime.Object{daemonSet(false)}, 0, true, 1},
		{"auto, DaemonSet gone", KeepAuto, nil, 0, false, 1},
		{"auto, DaemonSet deleting", KeepAuto, []runtime.Object{daemonSet(true)}, 0, false, 1},
		{"auto, one timeout then there", KeepAuto, []runtime.Object{daemonSet(false)}, 1, true, 2},
		{"auto, API server down", KeepAuto, []runtime.Object{daemonSet(false)}, 99, false, exitTries},
		{"always", KeepAlways, nil, 0, true, 0},
		{"never", KeepNever, []runtime.Object{daemonSet(false)}, 0, false, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cs := fake.NewSimpleClientset(tc.objects...)
			gets := 0
			cs.PrependReactor("get", "daemonsets", func(k8stesting.Action) (bool, runtime.Object, error) {
				gets++
				if gets <= tc.failures {
					return true, nil, apierrors.NewServerTimeout(dsResource, "get", 1)
				}
				return false, nil, nil
			})
			keep, why := keepOnExit(tc.mode, cs, "meshcni-system", "meshcni-agent", 0)
			if keep != tc.keep || gets != tc.gets {
				t.Errorf("keep %v (%s) after %d GETs; want %v after %d", keep, why, gets, tc.keep, tc.gets)
			}
		})
	}
	if keep, why := keepOnExit(KeepAuto, nil, "meshcni-system", "meshcni-agent", 0); keep || !strings.Contains(why, "without API access") {
		t.Errorf("auto without API access: keep %v (%s)", keep, why)
	}
	if keep, why := keepOnExit(KeepAuto, fake.NewSimpleClientset(daemonSet(false)), "meshcni-system", "", 0); keep || !strings.Contains(why, "--daemonset-name") {
		t.Errorf("auto without a DaemonSet name: keep %v (%s)", keep, why)
	}
}

// TestAgentExitAuto: the running agent, stopped, keeps the plugin while its DaemonSet
// exists and removes it once the DaemonSet is gone.
func TestAgentExitAuto(t *testing.T) {
	for _, there := range []bool{true, false} {
		t.Run(fmt.Sprintf("daemonset-%v", there), func(t *testing.T) {
			e := newEnv(t)
			if err := fileutil.WriteFileAtomic(filepath.Join(e.confDir, "10-calico.conflist"), []byte(calico), 0o644); err != nil {
				t.Fatal(err)
			}
			var objs []runtime.Object
			if there {
				objs = append(objs, daemonSet(false))
			}
			kube := NewKubeFor(fake.NewSimpleClientset(objs...), "")
			t.Cleanup(kube.Stop)
			r := startAgentKube(t, e.args("--pod-namespace", "meshcni-system", "--daemonset-name", "meshcni-agent"), nil, kube)
			eventually(t, 5*time.Second, "ready", r.a.Guard.Ready)
			if err := r.stop(); err != nil {
				t.Fatal(err)
			}
			err := r.a.Guard.Ready()
			if there && err != nil {
				t.Errorf("DaemonSet there, the plugin was removed: %v", err)
			}
			if !there && err == nil {
				t.Error("DaemonSet gone, the plugin is still installed")
			}
			if !strings.Contains(r.log.String(), map[bool]string{true: "keeping the plugin installed on exit", false: "removing the plugin on exit"}[there]) {
				t.Errorf("log:\n%s", r.log.String())
			}
		})
	}
}
