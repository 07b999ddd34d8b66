package testbed

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
)

// ContainerProcess returns the host PID of the process named comm (its
// /proc/PID/comm) in the container of pod p named container: the one process whose
// cgroup names the container's ID. Every node of the test bed shares the host's PID
// namespace, so this finds a container's process on any node (to SIGSTOP an agent,
// say). It fails unless exactly one process matches.
func ContainerProcess(p *corev1.Pod, container, comm string) (int, error) {
	var id string
	for _, s := range p.Status.ContainerStatuses {
		if s.Name == container {
			_, id, _ = strings.Cut(s.ContainerID, "://")
		}
	}
	if id == "" {
		return 0, fmt.Errorf("pod %s/%s: no ID for container %s", p.Namespace, p.Name, container)
	}
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return 0, fmt.Errorf("list processes: %w", err)
	}
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		c, err1 := os.ReadFile("/proc/" + e.Name() + "/comm")
		cg, err2 := os.ReadFile("/proc/" + e.Name() + "/cgroup")
		if err1 == nil && err2 == nil && strings.TrimSpace(string(c)) == comm && strings.Contains(string(cg), id) {
			pids = append(pids, pid)
		}
	}
	if len(pids) != 1 {
		return 0, fmt.Errorf("pod %s/%s container %.12s on %s: %s processes %v, want one", p.Namespace, p.Name, id, p.Spec.NodeName, comm, pids)
	}
	return pids[0], nil
}
