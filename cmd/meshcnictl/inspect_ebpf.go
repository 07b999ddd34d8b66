package main

import (
	"context"
	"fmt"
	"time"

	"github.com/meshcni/meshcni/pkg/agentsock"
	"github.com/meshcni/meshcni/pkg/netnsutil"
)

// defaultAgentRunDir is the chart's runDir: the agent's socket directory when
// neither --agent-run-dir nor the node's meshcni entry (cni_agent_run_dir) names one.
const defaultAgentRunDir = "/var/run/meshcni"

// Values of inspect's "ebpf" field.
const (
	ebpfAccelerated    = "accelerated"
	ebpfNotAccelerated = "not accelerated"
	ebpfUnknown        = "unknown: "
)

// ebpfAsker asks the agent about a netns cookie (agentsock.Client.EBPF).
type ebpfAsker func(ctx context.Context, cookie uint64) (*agentsock.EBPFResponse, error)

// ebpfState is the "ebpf" field and its reason: whether the agent has the netns at
// netnsPath on its eBPF acceleration allow-list, or why that is unknown.
func ebpfState(ctx context.Context, netnsPath string, cookieOf func(string) (uint64, error), ask ebpfAsker) (state, reason string) {
	cookie, err := cookieOf(netnsPath)
	if err != nil {
		return ebpfUnknown + err.Error(), ""
	}
	resp, err := ask(ctx, cookie)
	return ebpfVerdict(resp, err)
}

// ebpfVerdict turns the agent's answer into the "ebpf" field and its reason.
func ebpfVerdict(resp *agentsock.EBPFResponse, err error) (state, reason string) {
	switch {
	case err != nil:
		return ebpfUnknown + "ask meshcni's agent: " + err.Error(), ""
	case !resp.Available:
		reason = "the agent has not loaded eBPF acceleration"
		if resp.Reason != "" {
			reason += ": " + resp.Reason
		}
		return ebpfNotAccelerated, reason
	case resp.Accelerated:
		return ebpfAccelerated, ""
	}
	return ebpfNotAccelerated, "not on the agent's acceleration allow-list"
}

// askAgent dials the agent's socket in runDir for one EBPF request.
func askAgent(runDir string) ebpfAsker {
	return func(ctx context.Context, cookie uint64) (*agentsock.EBPFResponse, error) {
		ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		c, err := agentsock.Dial(runDir)
		if err != nil {
			return nil, fmt.Errorf("socket in %s (--agent-run-dir): %w", runDir, err)
		}
		defer c.Close()
		return c.EBPF(ctx, cookie)
	}
}

// inspectEBPF fills the report's ebpf fields for the netns read through enter.
func (r *inspectReport) inspectEBPF(ctx context.Context, enter, runDir string) {
	r.EBPF, r.EBPFReason = ebpfState(ctx, enter, netnsutil.Cookie, askAgent(runDir))
}
