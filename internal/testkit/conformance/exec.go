package conformance

import "os/exec"

func runCmd(path string, args ...string) ([]byte, error) {
	return exec.Command(path, args...).CombinedOutput()
}
