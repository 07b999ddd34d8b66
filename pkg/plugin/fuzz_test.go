package plugin

import (
	"errors"
	"io"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"

	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/cniconf"
)

// cniCode fails unless err is a *types.Error whose code is one of codes.
func cniCode(t *testing.T, what string, err error, codes ...uint) *types.Error {
	t.Helper()
	var e *types.Error
	if !errors.As(err, &e) {
		t.Fatalf("%s: error %v (%T) is not a CNI error", what, err, err)
	}
	for _, c := range codes {
		if e.Code == c {
			return e
		}
	}
	t.Fatalf("%s: CNI error code %d (%s), want one of %v", what, e.Code, e.Msg, codes)
	return nil
}

func absClean(p string) bool { return filepath.IsAbs(p) && filepath.Clean(p) == p }

// FuzzParseConfig: a CNI invocation's stdin is either a CNI error (decoding failure
// or invalid network config, its message starting "meshcni config") or a Config
// whose paths are absolute and clean, whose namespaces are valid and unique, whose
// backend is a known kind and whose api_timeout is within its bounds. With and
// without the prevResult the answer is the same for the rest of the document.
func FuzzParseConfig(f *testing.F) {
	for _, s := range []string{
		`{"cniVersion":"1.0.0","name":"k8s-pod-network","type":"meshcni","cni_agent_run_dir":"/var/run/meshcni"}`,
		`{"cniVersion":"1.0.0","name":"n","type":"meshcni","cni_agent_run_dir":"/run/meshcni/../x//","exclude_namespaces":["kube-system","kube-system"],"kubernetes":{"kubeconfig":"/etc/cni/net.d/meshcni-kubeconfig","exclude_namespaces":["istio-system"]},"backend":"iptables","api_timeout":"5s","plugin_log_level":"DEBUG","agent_pod_namespace":"meshcni-system","agent_pod_label":"k8s-app=agent","ipv6":"Drop"}`,
		`{"cniVersion":"1.0.0","type":"meshcni","cni_agent_run_dir":"/r","native_nftables":true,"backend":"auto","api_timeout":2.5}`,
		`{"cniVersion":"1.0.0","type":"meshcni","cni_agent_run_dir":"/r","prevResult":` + prevResult100 + `}`,
		`{"cniVersion":"0.3.1","type":"meshcni","cni_agent_run_dir":"/r","prevResult":{"cniVersion":"0.3.1","ips":[{"version":"4","address":"10.0.0.5/24"}]}}`,
		`{"cniVersion":"1.0.0","type":"meshcni","cni_agent_run_dir":"relative"}`,
		`{"cniVersion":"1.0.0","type":"meshcni","cni_agent_run_dir":"/r","api_timeout":1e300}`,
		`{"cniVersion":"1.0.0","type":"meshcni","cni_agent_run_dir":"/r","exclude_namespaces":["Kube\nSystem"]}`,
		`{"cniVersion":"1.0.0","type":"meshcni","cni_agent_run_dir":"/r","prevResult":{"cniVersion":"9.9.9"}}`,
		`{"cniVersion":"1.0.0",`, `null`, `[]`, ``,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, stdin []byte) {
		c, err := ParseConfig(stdin)
		c2, err2 := parseConfig(stdin, false)
		if err != nil {
			e := cniCode(t, "ParseConfig", err, types.ErrDecodingFailure, types.ErrInvalidNetworkConfig)
			if !strings.HasPrefix(e.Msg, "meshcni config") {
				t.Fatalf("ParseConfig: message %q does not say it is meshcni's config", e.Msg)
			}
			if err2 != nil {
				cniCode(t, "parseConfig without prevResult", err2, types.ErrDecodingFailure, types.ErrInvalidNetworkConfig)
				return
			}
			if !strings.Contains(e.Msg, "prevResult") {
				t.Fatalf("only the prevResult differs, yet the error does not name it: %q", e.Msg)
			}
			c = c2
		} else if err2 != nil {
			t.Fatalf("accepted with the prevResult, rejected without: %v", err2)
		}
		if c.AgentRunDir != "" && !absClean(c.AgentRunDir) || !absClean(c.Kubeconfig) {
			t.Fatalf("paths not absolute and clean: run dir %q, kubeconfig %q", c.AgentRunDir, c.Kubeconfig)
		}
		seen := map[string]bool{}
		for _, ns := range c.ExcludeNamespaces {
			if !cniconf.IsNamespaceName(ns) || seen[ns] {
				t.Fatalf("exclude_namespaces %q: invalid or repeated %q", c.ExcludeNamespaces, ns)
			}
			seen[ns] = true
		}
		if c.AgentNamespace != "" && !cniconf.IsNamespaceName(c.AgentNamespace) {
			t.Fatalf("agent namespace %q", c.AgentNamespace)
		}
		switch c.Backend {
		case backend.Auto, backend.Nftables, backend.IptablesNft, backend.IptablesLegacy:
		default:
			t.Fatalf("backend %q", c.Backend)
		}
		if !c.IPv6.Valid() {
			t.Fatalf("ipv6 %q", c.IPv6)
		}
		if c.APITimeout <= 0 || c.APITimeout > MaxAPITimeout {
			t.Fatalf("api_timeout %v", c.APITimeout)
		}
		if c.AgentLabel.Key == "" || strings.ContainsAny(c.AgentLabel.Key+c.AgentLabel.Value, " ,\n") {
			t.Fatalf("agent label %+v", c.AgentLabel)
		}
	})
}

// FuzzCNIArgs: CNI_ARGS are parsed as at every invocation (Plugin.begin, with a
// config that dials no socket). A malformed CNI_ARGS is a CNI error with code
// ErrInvalidEnvironmentVariables; the namespace, name and UID taken from it are the
// values of their own K8S_POD_* pair, never holding ';' or '='. A namespace and pod
// name that pass the checks fetchPod applies before any API call are DNS names.
func FuzzCNIArgs(f *testing.F) {
	for _, s := range []string{
		"", "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_UID=1234-5678",
		"K8S_POD_NAMESPACE=default;K8S_POD_NAME=web.example", "K8S_POD_NAME", "K8S_POD_NAME=a=b", ";;", "K8S_POD_NAMESPACE=a;K8S_POD_NAMESPACE=b",
		"IgnoreUnknown=maybe;X=1", "K8S_POD_NAMESPACE=../../etc;K8S_POD_NAME=web\n", "IgnoreUnknown=false;FOO=bar",
	} {
		f.Add(s)
	}
	stdin := []byte(`{"cniVersion":"1.0.0","name":"n","type":"meshcni","kubernetes":{"kubeconfig":"/nonexistent/kubeconfig"}}`)
	p := &Plugin{Stderr: io.Discard}
	f.Fuzz(func(t *testing.T, args string) {
		inv, err := p.begin(&skel.CmdArgs{ContainerID: "c", Args: args, StdinData: stdin}, true)
		if err != nil {
			cniCode(t, "begin", err, types.ErrInvalidEnvironmentVariables)
			return
		}
		pairs := strings.Split(args, ";")
		for _, v := range []struct{ key, val string }{{"K8S_POD_NAMESPACE", inv.namespace}, {"K8S_POD_NAME", inv.name}, {"K8S_POD_UID", inv.uid}} {
			if strings.ContainsAny(v.val, ";=") {
				t.Fatalf("%s %q holds ';' or '='", v.key, v.val)
			}
			found := v.val == ""
			for _, pr := range pairs {
				found = found || pr == v.key+"="+v.val
			}
			if !found {
				t.Fatalf("%s %q is not the value of a pair in %q", v.key, v.val, args)
			}
		}
		if cniconf.IsNamespaceName(inv.namespace) && isPodName(inv.name) {
			for _, s := range []string{inv.namespace, inv.name} {
				if strings.Trim(s, "abcdefghijklmnopqrstuvwxyz0123456789-.") != "" || strings.Contains(s, "..") || strings.HasPrefix(s, ".") {
					t.Fatalf("namespace %q / name %q accepted for an API call", inv.namespace, inv.name)
				}
			}
		}
	})
}
