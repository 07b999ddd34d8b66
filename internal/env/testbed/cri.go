package testbed

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// criClient talks CRI to a containerd of the test bed.
type criClient struct {
	conn *grpc.ClientConn
	rt   runtimeapi.RuntimeServiceClient
}

// dialCRIAt talks CRI to the containerd listening on sock (a node's socket as
// the host sees it: /proc/<containerd pid>/root/...).
func dialCRIAt(sock string) (*criClient, error) {
	if _, err := os.Stat(sock); err != nil {
		return nil, fmt.Errorf("containerd socket: %w", err)
	}
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, fmt.Errorf("dial CRI: %w", err)
	}
	return &criClient{conn: conn, rt: runtimeapi.NewRuntimeServiceClient(conn)}, nil
}

func (c *criClient) Close() { _ = c.conn.Close() }

// sandboxInfo is the subset of containerd's verbose PodSandboxStatus info used here.
type sandboxInfo struct {
	Pid         int `json:"pid"`
	RuntimeSpec struct {
		Linux struct {
			Namespaces []struct {
				Type string `json:"type"`
				Path string `json:"path"`
			} `json:"namespaces"`
		} `json:"linux"`
	} `json:"runtimeSpec"`
}

// podNetns finds the network namespace path of the ready sandbox of the pod with
// the given UID: the sandbox's netns bind mount, or /proc/<pause pid>/ns/net.
func (c *criClient) podNetns(ctx context.Context, podUID string) (string, error) {
	resp, err := c.rt.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{Filter: &runtimeapi.PodSandboxFilter{
		State:         &runtimeapi.PodSandboxStateValue{State: runtimeapi.PodSandboxState_SANDBOX_READY},
		LabelSelector: map[string]string{"io.kubernetes.pod.uid": podUID},
	}})
	if err != nil {
		return "", fmt.Errorf("list sandboxes: %w", err)
	}
	if len(resp.Items) == 0 {
		return "", fmt.Errorf("no ready sandbox for pod uid %s", podUID)
	}
	st, err := c.rt.PodSandboxStatus(ctx, &runtimeapi.PodSandboxStatusRequest{PodSandboxId: resp.Items[0].Id, Verbose: true})
	if err != nil {
		return "", fmt.Errorf("sandbox status: %w", err)
	}
	var info sandboxInfo
	if err := json.Unmarshal([]byte(st.Info["info"]), &info); err != nil {
		return "", fmt.Errorf("sandbox info: %w", err)
	}
	for _, ns := range info.RuntimeSpec.Linux.Namespaces {
		if ns.Type == "network" && ns.Path != "" {
			return ns.Path, nil
		}
	}
	if info.Pid > 0 {
		return fmt.Sprintf("/proc/%d/ns/net", info.Pid), nil
	}
	return "", fmt.Errorf("sandbox %s has no network namespace", resp.Items[0].Id)
}

// removeAll stops and removes every pod sandbox (which runs CNI DEL, kills the
// pods' processes through their shims and unmounts their network namespaces),
// several at once.
func (c *criClient) removeAll(ctx context.Context) error {
	resp, err := c.rt.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{})
	if err != nil {
		return fmt.Errorf("list sandboxes: %w", err)
	}
	var (
		mu       sync.Mutex
		firstErr error
		wg       sync.WaitGroup
		slots    = make(chan struct{}, removeParallel)
	)
	for _, s := range resp.Items {
		slots <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { <-slots; wg.Done() }()
			if err := c.remove(ctx, s); err != nil {
				mu.Lock()
				if firstErr == nil {
					firstErr = err
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return firstErr
}

// removeParallel is how many sandboxes removeAll removes at once.
const removeParallel = 8

// remove stops and removes one pod sandbox.
func (c *criClient) remove(ctx context.Context, s *runtimeapi.PodSandbox) error {
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	var stopErr error
	if _, err := c.rt.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: s.Id}); err != nil {
		stopErr = fmt.Errorf("stop sandbox %s (%s/%s): %w", s.Id, s.Metadata.GetNamespace(), s.Metadata.GetName(), err)
	}
	if _, err := c.rt.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: s.Id}); err != nil && stopErr == nil {
		return fmt.Errorf("remove sandbox %s: %w", s.Id, err)
	}
	return stopErr
}
