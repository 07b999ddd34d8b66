package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	authv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/pkg/fileutil"
)

const tokNS = "agent-plugin-token"

// tokenFixture creates, as an administrator, what the chart creates for the plugin's
// identity (deploy/identity_test.go proves the chart's own objects): the agent's and the
// plugin's ServiceAccounts, get pods for the plugin, list/watch pods and a TokenRequest
// for the plugin's ServiceAccount only for the agent; and the agent's Pod on a node.
func tokenFixture(ctx context.Context, t *testing.T, tb *testbed.Testbed) (node string) {
	t.Helper()
	cs := tb.Client
	if err := tb.CreateNamespace(ctx, tokNS); err != nil && !apierrors.IsAlreadyExists(errors.Unwrap(err)) {
		t.Fatal(err)
	}
	must := func(_ any, err error) {
		t.Helper()
		if err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatal(err)
		}
	}
	for _, sa := range []string{"meshcni-agent", "meshcni-plugin"} {
		must(cs.CoreV1().ServiceAccounts(tokNS).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa}}, metav1.CreateOptions{}))
	}
	sub := func(sa string) []rbacv1.Subject {
		return []rbacv1.Subject{{Kind: "ServiceAccount", Name: sa, Namespace: tokNS}}
	}
	for name, rule := range map[string]rbacv1.PolicyRule{
		tokNS + "-plugin": {APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get"}},
		tokNS + "-agent":  {APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"list", "watch"}},
	} {
		sa := "meshcni-" + strings.TrimPrefix(name, tokNS+"-")
		must(cs.RbacV1().ClusterRoles().Create(ctx, &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: name}, Rules: []rbacv1.PolicyRule{rule}}, metav1.CreateOptions{}))
		must(cs.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: name},
			RoleRef: rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: name}, Subjects: sub(sa)}, metav1.CreateOptions{}))
		t.Cleanup(func() {
			_ = cs.RbacV1().ClusterRoleBindings().Delete(context.Background(), name, metav1.DeleteOptions{})
			_ = cs.RbacV1().ClusterRoles().Delete(context.Background(), name, metav1.DeleteOptions{})
		})
	}
	must(cs.RbacV1().Roles(tokNS).Create(ctx, &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: "mint"}, Rules: []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"serviceaccounts/token"}, ResourceNames: []string{"meshcni-plugin"}, Verbs: []string{"create"}}}}, metav1.CreateOptions{}))
	grantMint(ctx, t, cs)

	node = "agent-plugin-token-node"
	image := "meshcni.local/none:dev"
	if tb.Mode == testbed.ModeAPIOnly {
		must(cs.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: node}}, metav1.CreateOptions{}))
		t.Cleanup(func() { _ = cs.CoreV1().Nodes().Delete(context.Background(), node, metav1.DeleteOptions{}) })
	} else {
		node, image = testbed.NodeName, testbed.PauseImage
	}
	no := false
	must(cs.CoreV1().Pods(tokNS).Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "meshcni-agent-x"}, Spec: corev1.PodSpec{
		NodeName: node, ServiceAccountName: "meshcni-agent", AutomountServiceAccountToken: &no,
		Containers: []corev1.Container{{Name: "agent", Image: image, ImagePullPolicy: corev1.PullNever}},
	}}, metav1.CreateOptions{}))
	t.Cleanup(func() {
		zero := int64(0)
		_ = cs.CoreV1().Pods(tokNS).Delete(context.Background(), "meshcni-agent-x", metav1.DeleteOptions{GracePeriodSeconds: &zero})
	})
	return node
}

func grantMint(ctx context.Context, t *testing.T, cs kubernetes.Interface) {
	t.Helper()
	_, err := cs.RbacV1().RoleBindings(tokNS).Create(ctx, &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "mint"},
		RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "Role", Name: "mint"},
		Subjects: []rbacv1.Subject{{Kind: "ServiceAccount", Name: "meshcni-agent", Namespace: tokNS}}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
}

func tokenClient(t *testing.T, tb *testbed.Testbed, token string) kubernetes.Interface {
	t.Helper()
	cs, err := kubernetes.NewForConfig(&rest.Config{Host: tb.RESTConfig.Host, BearerToken: token, TLSClientConfig: rest.TLSClientConfig{CAData: tb.RESTConfig.CAData}})
	if err != nil {
		t.Fatal(err)
	}
	return cs
}

// pluginKubeconfig reads the plugin's kubeconfig: its token, inode and a client.
func pluginKubeconfig(t *testing.T, path string) (token string, ino uint64, cs kubernetes.Interface) {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("plugin kubeconfig mode %v, want 0600", fi.Mode().Perm())
	}
	cfg, err := clientcmd.LoadFromFile(path)
	if err != nil {
		t.Fatal(err)
	}
	rc, err := clientcmd.NewDefaultClientConfig(*cfg, nil).ClientConfig()
	if err != nil {
		t.Fatal(err)
	}
	cs, err = kubernetes.NewForConfig(rc)
	if err != nil {
		t.Fatal(err)
	}
	return rc.BearerToken, fi.Sys().(*syscall.Stat_t).Ino, cs
}

// TestPluginTokenRotation runs the agent against a real API server with its own
// ServiceAccount's pod-bound token, as in a DaemonSet pod. It mints the plugin's token
// (a real TokenRequest; the API server's shortest lifetime, 10 min, so the renewal is
// triggered through the timer hook, not by waiting), writes it into the plugin's
// kubeconfig (0600), and on each renewal replaces the file (temp + rename) with a new
// token that works; a renewal the API server refuses keeps the current token and is
// retried with backoff.
func TestPluginTokenRotation(t *testing.T) {
	tb := testbed.API(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	node := tokenFixture(ctx, t, tb)
	cs := tb.Client
	exp := int64(600)
	tr, err := cs.CoreV1().ServiceAccounts(tokNS).CreateToken(ctx, "meshcni-agent", &authv1.TokenRequest{Spec: authv1.TokenRequestSpec{
		ExpirationSeconds: &exp, BoundObjectRef: &authv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: "meshcni-agent-x"}}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	kube := NewKubeFor(tokenClient(t, tb, tr.Status.Token), node)
	defer kube.Stop()

	e := newEnv(t)
	if err := fileutil.WriteFileAtomic(filepath.Join(e.confDir, "10-calico.conflist"), []byte(calico), 0o644); err != nil {
		t.Fatal(err)
	}
	caFile := filepath.Join(e.root, "ca.crt")
	if err := os.WriteFile(caFile, tb.RESTConfig.CAData, 0o644); err != nil {
		t.Fatal(err)
	}
	host, port, _ := strings.Cut(strings.TrimPrefix(tb.RESTConfig.Host, "https://"), ":")
	getenv := func(k string) string {
		return map[string]string{"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port}[k]
	}
	args := e.args("--kubeconfig-source", "", "--ca-file", caFile, "--pod-name", "meshcni-agent-x", "--pod-namespace", tokNS,
		"--node-name", node, "--plugin-token-expiration", "10m", "--repair=false")
	waits := make(chan time.Duration, 8)
	fire := make(chan time.Time)
	r := startAgentWith(t, args, Options{Getenv: getenv, Kube: kube}, func(a *Agent) {
		a.PluginToken.after = func(d time.Duration) <-chan time.Time { waits <- d; return fire }
	})
	pt := r.a.PluginToken
	next := func(what string) time.Duration {
		t.Helper()
		select {
		case d := <-waits:
			return d
		case <-time.After(time.Minute):
			t.Fatalf("%s: the agent did not schedule its next renewal\n%s", what, r.log.String())
			return 0
		}
	}
	kcPath := filepath.Join(e.runDir, KubeconfigName)

	// The first token: minted at start, renewal scheduled at 70-80 % of what was granted.
	d := next("first token")
	life := time.Until(pt.Holder.Expires())
	if life < 9*time.Minute || life > 10*time.Minute {
		t.Errorf("granted lifetime %v, want the 10m asked", life)
	}
	if d < 7*time.Minute-5*time.Second || d > 8*time.Minute {
		t.Errorf("renewal in %v, want 70-80 %% of 10m", d)
	}
	eventually(t, 10*time.Second, "ready with the plugin's kubeconfig", r.a.Guard.Ready)
	tok1, ino1, plugin := pluginKubeconfig(t, kcPath)
	u, err := plugin.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if ui := u.Status.UserInfo; ui.Username != "system:serviceaccount:"+tokNS+":meshcni-plugin" || fmt.Sprint(ui.Extra["authentication.kubernetes.io/node-name"]) != "["+node+"]" {
		t.Errorf("the plugin's kubeconfig authenticates as %s %v, want the plugin's ServiceAccount on node %s", ui.Username, ui.Extra, node)
	}
	if _, err := plugin.CoreV1().Pods(tokNS).Get(ctx, "meshcni-agent-x", metav1.GetOptions{}); err != nil {
		t.Errorf("plugin get pod: %v", err)
	}
	if _, err := plugin.CoreV1().Pods(tokNS).List(ctx, metav1.ListOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("plugin list pods: %v, want Forbidden", err)
	}

	// Renewal: a new token, the file replaced (a new inode), the new token works.
	fire <- time.Now()
	d = next("renewal")
	if d < 7*time.Minute-5*time.Second || d > 8*time.Minute {
		t.Errorf("next renewal in %v, want 70-80 %% of 10m", d)
	}
	eventually(t, 10*time.Second, "kubeconfig rewritten with the new token", func() error {
		if tok, _, _ := pluginKubeconfig(t, kcPath); tok == tok1 {
			return errors.New("still the first token")
		}
		return nil
	})
	tok2, ino2, plugin := pluginKubeconfig(t, kcPath)
	if ino2 == ino1 {
		t.Error("kubeconfig rewritten in place, want temp + rename")
	}
	if _, err := plugin.CoreV1().Pods(tokNS).Get(ctx, "meshcni-agent-x", metav1.GetOptions{}); err != nil {
		t.Errorf("plugin get pod with the renewed token: %v", err)
	}
	if got := promtest.ToFloat64(r.a.Metrics.TokenRenewals.WithLabelValues("success")); got != 2 {
		t.Errorf("renewals_total{success} = %v, want 2", got)
	}
	if got := promtest.ToFloat64(r.a.Metrics.TokenExpiry); got != float64(pt.Holder.Expires().Unix()) {
		t.Errorf("expiry gauge %v, want %d", got, pt.Holder.Expires().Unix())
	}

	// The API server refuses the next renewal (RBAC revoked): the current token stays in
	// the kubeconfig, the agent stays ready, and retries within about a second.
	if err := cs.RbacV1().RoleBindings(tokNS).Delete(ctx, "mint", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "RBAC revoked", func() error {
		_, err := kube.Client.CoreV1().ServiceAccounts(tokNS).CreateToken(ctx, "meshcni-plugin", &authv1.TokenRequest{}, metav1.CreateOptions{})
		if !apierrors.IsForbidden(err) {
			return fmt.Errorf("TokenRequest: %v", err)
		}
		return nil
	})
	fire <- time.Now()
	if d = next("failed renewal"); d < 800*time.Millisecond || d > 1200*time.Millisecond {
		t.Errorf("retry in %v, want 1 s ± 20 %%", d)
	}
	if tok, _, _ := pluginKubeconfig(t, kcPath); tok != tok2 {
		t.Error("a failed renewal changed the kubeconfig")
	}
	if err := r.a.Guard.Ready(); err != nil {
		t.Errorf("a failed renewal before expiry: not ready: %v", err)
	}
	if got := promtest.ToFloat64(r.a.Metrics.TokenRenewals.WithLabelValues("error")); got != 1 {
		t.Errorf("renewals_total{error} = %v, want 1", got)
	}
	if !strings.Contains(r.log.String(), "cannot mint the plugin's token") {
		t.Errorf("no log line of the failed renewal:\n%s", r.log.String())
	}

	// RBAC back: the retry succeeds.
	grantMint(ctx, t, cs)
	eventually(t, 10*time.Second, "RBAC restored", func() error {
		_, err := kube.Client.CoreV1().ServiceAccounts(tokNS).CreateToken(ctx, "meshcni-plugin", &authv1.TokenRequest{}, metav1.CreateOptions{})
		return err
	})
	fire <- time.Now()
	if d = next("retry"); d < 7*time.Minute-5*time.Second {
		t.Errorf("after a successful retry, next renewal in %v", d)
	}
	eventually(t, 10*time.Second, "third token", func() error {
		if tok, _, _ := pluginKubeconfig(t, kcPath); tok == tok2 {
			return errors.New("still the second token")
		}
		return nil
	})
}
