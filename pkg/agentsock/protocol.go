// Package agentsock is the protocol between the meshcni CNI plugin and the node agent:
// JSON lines over a unix stream socket in the agent's run directory.
//
// Every line is one Message. The plugin sends "log" and "cmd" messages, one way: the
// agent does not answer them. A "req" message carries an ID and is answered by one
// "resp" message with the same ID. The one question so far is RequestPod: a pod from
// the agent's informer cache of its node's pods, so that the plugin need not open a
// TLS connection to the API server. An agent answers a request kind it does not know
// with an error, so a newer plugin can talk to an older agent.
//
// A "release" message carries file descriptors (SCM_RIGHTS) and nothing to answer: the
// agent holds them (at most MaxHeldFDs per connection) until the connection ends, and
// closes them Server.Linger (1 s) later, so that its close is the last one (the plugin
// closes its copies before the connection) and comes after the kernel's grace period. The plugin hands over its nftables netlink sockets this way,
// because the kernel makes the last close of such a socket wait for an RCU grace
// period (several milliseconds) after nftables objects were deleted, which a CNI
// command need not wait for.
//
// The client side (Dial, Client) uses only the standard library: it is linked into
// the CNI plugin, which must stay small, start fast and never wait on the agent for
// more than a few milliseconds.
package agentsock

import (
	"encoding/json"
	"path/filepath"
	"time"
)

// SocketName is the socket's file name in the run directory.
const SocketName = "agent.sock"

// Version is the protocol version carried by every message.
const Version = 1

// Path returns the socket path in runDir.
func Path(runDir string) string { return filepath.Join(runDir, SocketName) }

// Message kinds.
const (
	KindLog      = "log"
	KindCommand  = "cmd"
	KindRequest  = "req"
	KindResponse = "resp"
	KindRelease  = "release"
)

// Message is one line on the socket.
type Message struct {
	V    int            `json:"v"`
	Kind string         `json:"kind"`
	ID   uint64         `json:"id,omitempty"`
	Log  *LogRecord     `json:"log,omitempty"`
	Cmd  *CommandResult `json:"cmd,omitempty"`
	Req  *Request       `json:"req,omitempty"`
	Resp *Response      `json:"resp,omitempty"`
}

// Pod names the pod a CNI command is for.
type Pod struct {
	Namespace string `json:"namespace,omitempty"`
	Name      string `json:"name,omitempty"`
}

// LogRecord is one of the plugin's log records.
type LogRecord struct {
	Time  time.Time      `json:"time"`
	Level string         `json:"level"` // slog level name: DEBUG, INFO, WARN, ERROR
	Msg   string         `json:"msg"`
	Pod   Pod            `json:"pod"`
	Attrs map[string]any `json:"attrs,omitempty"`
}

// CNI commands and results of a CommandResult.
const (
	CommandAdd   = "ADD"
	CommandDel   = "DEL"
	CommandCheck = "CHECK"

	ResultSuccess = "success"
	ResultError   = "error"
)

// CommandResult is the outcome of one CNI command.
type CommandResult struct {
	Command  string  `json:"command"`
	Result   string  `json:"result"`
	Seconds  float64 `json:"duration_seconds"`
	Pod      Pod     `json:"pod"`
	ErrorMsg string  `json:"error,omitempty"`
	// ContainerID is the pod sandbox's (CNI_CONTAINERID): the agent pairs an ADD's
	// EBPF with the sandbox's DEL by it.
	ContainerID string `json:"container_id,omitempty"`
	// EBPF is set on a successful ADD of a meshed pod whose eBPF acceleration is
	// not off by annotation: what the agent needs to enable it (pkg/agent/ebpf.go).
	EBPF *PodEBPF `json:"ebpf,omitempty"`
	// Sandbox is set on a successful ADD of a Kubernetes pod, meshed or not: what
	// the ADD decided and the sandbox's network namespace (pkg/agent/sandboxes.go).
	Sandbox *Sandbox `json:"sandbox,omitempty"`
}

// Decisions of a Sandbox.
const (
	DecisionMeshed  = "meshed"
	DecisionSkipped = "skipped"
)

// Sandbox is what one ADD decided about its pod, and the sandbox's network
// namespace as the plugin read it from CNI_NETNS.
type Sandbox struct {
	// PodUID is K8S_POD_UID, when the runtime gives it.
	PodUID string `json:"pod_uid,omitempty"`
	// Decision is DecisionMeshed or DecisionSkipped, Reason the plugin's why.
	Decision string `json:"decision"`
	Reason   string `json:"reason,omitempty"`
	// Netns is CNI_NETNS; NetnsDev and NetnsInode identify the namespace file
	// (0: unreadable), NetnsCookie is its SO_NETNS_COOKIE (0: unknown).
	Netns       string `json:"netns,omitempty"`
	NetnsDev    uint64 `json:"netns_dev"`
	NetnsInode  uint64 `json:"netns_inode"`
	NetnsCookie uint64 `json:"netns_cookie"`
}

// PodEBPF is a meshed pod's network namespace as eBPF acceleration needs it.
type PodEBPF struct {
	// NetnsCookie is the pod netns's SO_NETNS_COOKIE, read by the plugin inside it.
	NetnsCookie uint64 `json:"netns_cookie"`
	// Mode is the pod's meshcni.io/ebpf-acceleration annotation, parsed
	// (to-proxy or both); empty: the pod has none and the agent's default applies.
	Mode string `json:"mode,omitempty"`
	// ProxyUID is the UID of the pod's proxy, whose connections to the network
	// are left alone.
	ProxyUID uint32 `json:"proxy_uid"`
	// PodUID is K8S_POD_UID, when the runtime gives it: the agent disables the
	// pod's entry when this pod (not a later one of the same name) is deleted.
	PodUID string `json:"pod_uid,omitempty"`
}

// Request asks the agent something; Body's shape depends on Type.
type Request struct {
	Type string          `json:"type"`
	Body json.RawMessage `json:"body,omitempty"`
}

// Response answers a Request.
type Response struct {
	Error string          `json:"error,omitempty"`
	Body  json.RawMessage `json:"body,omitempty"`
}

// RequestPod asks for one pod from the agent's cache of its node's pods. Body:
// PodRequest; answer: PodResponse.
const RequestPod = "pod"

// PodRequest names the pod the runtime is creating. UID, when set, is K8S_POD_UID.
type PodRequest struct {
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	UID       string `json:"uid,omitempty"`
}

// PodResponse answers a RequestPod. Found is false when the cache cannot answer
// (the agent has no API access, its cache is not synced yet, the pod is not in it,
// or it has another UID); Reason then says which, and the plugin asks the API server.
// Pod is the pod as the JSON of a capture.Pod (the fields meshcni reads, with the
// Kubernetes API's field names), which the plugin decodes without linking any
// Kubernetes package. The agentsock package itself stays free of Kubernetes packages.
type PodResponse struct {
	Found  bool            `json:"found"`
	Reason string          `json:"reason,omitempty"`
	Pod    json.RawMessage `json:"pod,omitempty"`
}

// RequestEBPF asks whether a network namespace is on the node's eBPF acceleration
// allow-list (meshcnictl inspect). Body: EBPFRequest; answer: EBPFResponse.
const RequestEBPF = "ebpf"

// EBPFRequest names a network namespace by its cookie (SO_NETNS_COOKIE).
type EBPFRequest struct {
	NetnsCookie uint64 `json:"netns_cookie"`
}

// EBPFResponse answers a RequestEBPF. Available is false when the agent has not
// loaded the acceleration; Reason then says why (off, or what the node lacks).
type EBPFResponse struct {
	Available   bool   `json:"available"`
	Reason      string `json:"reason,omitempty"`
	Accelerated bool   `json:"accelerated"`
}

// Log attribute keys lifted into LogRecord.Pod.
const (
	KeyPodNamespace = "pod_namespace"
	KeyPodName      = "pod_name"
)
