package deploy_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/meshcni/meshcni/internal/tools/build/image"
)

// The meshcni image of the package's full-test-bed tests, built once per test binary
// into imageDir (removed by TestMain). Its binaries are linked in the repository's
// bin/images/build, as the demo links them: a build whose sources did not change
// relinks nothing.
var (
	imageOnce sync.Once
	imageRes  *image.Result
	imageErr  error
	imageDir  = filepath.Join(os.TempDir(), fmt.Sprintf("meshcni-deploy-image-%d", os.Getpid()))
)

// builtImage returns the package's meshcni image (DefaultHub:DefaultTag), building
// it on first use.
func builtImage(ctx context.Context, t *testing.T, root string) *image.Result {
	t.Helper()
	imageOnce.Do(func() {
		began := time.Now()
		imageRes, imageErr = image.Build(ctx, image.Options{
			RepoRoot: root, Hub: image.DefaultHub, Tag: image.DefaultTag,
			Out: filepath.Join(imageDir, "meshcni.tar"), WorkDir: filepath.Join(root, "bin", "images", "build"),
		})
		if imageErr == nil {
			t.Logf("image %s built in %s", imageRes.Ref, time.Since(began).Round(time.Millisecond))
		}
	})
	if imageErr != nil {
		t.Fatalf("build the image: %v", imageErr)
	}
	return imageRes
}
