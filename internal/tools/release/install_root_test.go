package release

import (
	"context"
	"encoding/json"
	"errors"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshcni/meshcni/internal/env/testbed"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/internal/tools/build/image"
)

// TestInstallOnTestbed installs the release as a user would, on the real test bed: the
// image archive imported into containerd (as a registry pull would put it there), the
// packaged chart installed with no image values at all (its defaults must name the
// image built), the agent Ready running that image, then uninstalled.
func TestInstallOnTestbed(t *testing.T) {
	testutil.RequireRoot(t)
	if _, err := testbed.Lookup(); err != nil {
		if errors.Is(err, testbed.ErrNotBuilt) {
			testutil.Missing(t, "%v", err)
		}
		t.Fatal(err)
	}
	root, err := testutil.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	helm := helmFor(t, root)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	res, err := Build(ctx, Options{RepoRoot: root, Version: "0.9.0", Hub: "meshcni.local/release", Arches: []image.Arch{image.HostArch()},
		Out: filepath.Join(t.TempDir(), "0.9.0"), Helm: helm})
	if err != nil {
		t.Fatal(err)
	}
	tb, err := testbed.Start(ctx, testbed.Options{ImageArchives: []string{filepath.Join(res.Out, res.Image)}})
	if errors.Is(err, testbed.ErrRunning) {
		testutil.Missing(t, "a shared test bed is running (hack/testbed up): stop it to run this test")
	}
	if err != nil {
		t.Fatalf("test bed: %v", err)
	}
	t.Cleanup(func() { _ = tb.Stop(context.Background()) })

	// The test bed's own settings (CNI dirs, API server, pull policy) — every key but the
	// image's: hub and tag are the packaged chart's defaults.
	args := []string{"install", Release, filepath.Join(res.Out, res.Chart), "--namespace", Namespace, "--create-namespace", "--wait", "--timeout", "3m",
		"--set", "pullPolicy=Never",
		"--set", "cniBinDir=" + testbed.CNIBinDir, "--set", "cniConfDir=" + testbed.CNIConfDir,
		"--set", "repair.netnsDirs={" + testbed.NetnsDir + "}", "--set", "repair.hostProc=false",
		"--set", "taintController.replicas=1", "--set", "taintController.hostNetwork=true",
		"--set", "apiServer.host=" + testbed.APIServerHost, "--set", "apiServer.port=" + strconv.Itoa(testbed.APIServerPort),
	}
	run := func(args ...string) string {
		t.Helper()
		cmd := exec.CommandContext(ctx, helm, args...)
		cmd.Env = append(cmd.Environ(), "KUBECONFIG="+tb.Kubeconfig())
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("helm %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	run(args...)
	t.Cleanup(func() {
		cmd := exec.Command(helm, "uninstall", Release, "--namespace", Namespace, "--wait")
		cmd.Env = append(cmd.Environ(), "KUBECONFIG="+tb.Kubeconfig())
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("helm uninstall: %v\n%s", err, out)
		}
	})
	if _, err := tb.WaitDaemonSet(ctx, Namespace, "meshcni-agent"); err != nil {
		t.Fatalf("agent DaemonSet: %v", err)
	}
	pods, err := tb.Client.CoreV1().Pods(Namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	wantID := configDigest(t, filepath.Join(res.Out, res.Image))
	running := 0
	for _, p := range pods.Items {
		for _, c := range p.Spec.Containers {
			if c.Image != res.Ref {
				t.Errorf("pod %s container %s: image %s, want %s", p.Name, c.Name, c.Image, res.Ref)
			}
		}
		for _, s := range p.Status.ContainerStatuses {
			if s.ImageID != wantID {
				t.Errorf("pod %s container %s runs image ID %s, want %s (the config of the image built)", p.Name, s.Name, s.ImageID, wantID)
			}
			if s.State.Running != nil && s.Ready && p.Status.Phase == corev1.PodRunning {
				running++
				t.Logf("pod %s container %s Ready, image %s (%s)", p.Name, s.Name, s.Image, s.ImageID)
			}
		}
	}
	if running == 0 {
		t.Errorf("no container of the release Ready in %s", Namespace)
	}
}

// configDigest is the config digest (what the kubelet reports as a container's imageID)
// of this machine's image in an OCI layout archive: index.json → the image index →
// this platform's manifest → its config.
func configDigest(t *testing.T, archive string) string {
	t.Helper()
	blob := func(digest string) []byte {
		hex, ok := strings.CutPrefix(digest, "sha256:")
		if !ok {
			t.Fatalf("digest %q", digest)
		}
		return readTarFile(t, archive, "blobs/sha256/"+hex, false)
	}
	type desc struct {
		Digest   string `json:"digest"`
		Platform *struct {
			Architecture string `json:"architecture"`
		} `json:"platform"`
	}
	var doc struct {
		Manifests []desc `json:"manifests"`
		Config    desc   `json:"config"`
	}
	if err := json.Unmarshal(readTarFile(t, archive, "index.json", false), &doc); err != nil || len(doc.Manifests) != 1 {
		t.Fatalf("index.json: %v %+v", err, doc)
	}
	if err := json.Unmarshal(blob(doc.Manifests[0].Digest), &doc); err != nil {
		t.Fatal(err)
	}
	for _, m := range doc.Manifests {
		if m.Platform != nil && m.Platform.Architecture == runtime.GOARCH {
			var man struct{ Config desc }
			if err := json.Unmarshal(blob(m.Digest), &man); err != nil {
				t.Fatal(err)
			}
			return man.Config.Digest
		}
	}
	t.Fatalf("no %s image in %s", runtime.GOARCH, archive)
	return ""
}
