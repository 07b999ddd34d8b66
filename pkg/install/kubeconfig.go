package install

import (
	"bytes"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/meshcni/meshcni/pkg/fileutil"
)

// Service-account files of a pod.
const (
	DefaultTokenFile = "/var/run/secrets/kubernetes.io/serviceaccount/token"
	DefaultCAFile    = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
)

// KubeconfigSource makes the plugin's kubeconfig.
type KubeconfigSource interface {
	// Kubeconfig returns the kubeconfig's content, built from the source's files now.
	Kubeconfig() ([]byte, error)
	// WatchDirs are the directories whose changes may change the content.
	WatchDirs() []string
}

// InCluster builds a kubeconfig from the pod's service-account token and CA, for the
// API server at Host:Port.
type InCluster struct {
	TokenFile, CAFile string
	Host              string
	Port              uint16
}

// InClusterFromEnv reads the API server's address from KUBERNETES_SERVICE_HOST and
// KUBERNETES_SERVICE_PORT, as client-go's in-cluster configuration does.
func InClusterFromEnv(getenv func(string) string, tokenFile, caFile string) (*InCluster, error) {
	host, portStr := getenv("KUBERNETES_SERVICE_HOST"), getenv("KUBERNETES_SERVICE_PORT")
	if host == "" || portStr == "" {
		return nil, errors.New("not running in a pod: KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are not set (give --kubeconfig-source outside a cluster)")
	}
	if err := validHost(host); err != nil {
		return nil, fmt.Errorf("KUBERNETES_SERVICE_HOST: %w", err)
	}
	port, err := strconv.ParseUint(portStr, 10, 16)
	if err != nil || port == 0 {
		return nil, fmt.Errorf("KUBERNETES_SERVICE_PORT %q: not a port number", portStr)
	}
	return &InCluster{TokenFile: tokenFile, CAFile: caFile, Host: host, Port: uint16(port)}, nil
}

func validHost(host string) error {
	if net.ParseIP(host) != nil {
		return nil
	}
	if errs := validation.IsDNS1123Subdomain(host); len(errs) > 0 {
		return fmt.Errorf("%q is neither an IP address nor a DNS name: %s", host, strings.Join(errs, "; "))
	}
	return nil
}

// Server is the API server's URL; an IPv6 address is bracketed.
func (s *InCluster) Server() string {
	return "https://" + net.JoinHostPort(s.Host, strconv.Itoa(int(s.Port)))
}

// WatchDirs: projected volumes rotate through a "..data" symlink swap in the
// directory, so the directory is watched, not the file.
func (s *InCluster) WatchDirs() []string {
	dirs := []string{filepath.Dir(s.TokenFile)}
	if d := filepath.Dir(s.CAFile); d != dirs[0] {
		dirs = append(dirs, d)
	}
	return dirs
}

// Kubeconfig reads the token and CA and builds the kubeconfig.
func (s *InCluster) Kubeconfig() ([]byte, error) {
	token, err := os.ReadFile(s.TokenFile)
	if err != nil {
		return nil, fmt.Errorf("service-account token: %w", err)
	}
	tok := strings.TrimSpace(string(token))
	if tok == "" || strings.ContainsAny(tok, " \t\r\n") {
		return nil, fmt.Errorf("service-account token %s is empty or malformed", s.TokenFile)
	}
	return s.withToken(tok)
}

// withToken reads the CA and builds the kubeconfig with tok.
func (s *InCluster) withToken(tok string) ([]byte, error) {
	ca, err := os.ReadFile(s.CAFile)
	if err != nil {
		return nil, fmt.Errorf("service-account CA: %w", err)
	}
	if err := validCA(ca); err != nil {
		return nil, fmt.Errorf("service-account CA %s: %w", s.CAFile, err)
	}
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["local"] = &clientcmdapi.Cluster{Server: s.Server(), CertificateAuthorityData: ca}
	cfg.AuthInfos["meshcni"] = &clientcmdapi.AuthInfo{Token: tok}
	cfg.Contexts["meshcni"] = &clientcmdapi.Context{Cluster: "local", AuthInfo: "meshcni"}
	cfg.CurrentContext = "meshcni"
	return writeConfig(cfg)
}

func validCA(data []byte) error {
	n := 0
	for rest := data; ; {
		var block *pem.Block
		block, rest = pem.Decode(rest)
		if block == nil {
			break
		}
		if block.Type != "CERTIFICATE" {
			continue
		}
		if _, err := x509.ParseCertificate(block.Bytes); err != nil {
			return err
		}
		n++
	}
	if n == 0 {
		return errors.New("no PEM certificate")
	}
	return nil
}

func writeConfig(cfg *clientcmdapi.Config) ([]byte, error) {
	if err := clientcmd.Validate(*cfg); err != nil {
		return nil, fmt.Errorf("kubeconfig: %w", err)
	}
	out, err := clientcmd.Write(*cfg)
	if err != nil {
		return nil, fmt.Errorf("encode kubeconfig: %w", err)
	}
	return out, nil
}

// FromFile copies an existing kubeconfig, with the files it names embedded, for an
// agent running outside a pod.
type FromFile struct {
	Path string
}

// WatchDirs is the source file's directory.
func (s *FromFile) WatchDirs() []string { return []string{filepath.Dir(s.Path)} }

// Kubeconfig loads, validates and flattens the source.
func (s *FromFile) Kubeconfig() ([]byte, error) {
	cfg, err := clientcmd.LoadFromFile(s.Path)
	if err != nil {
		return nil, fmt.Errorf("kubeconfig source: %w", err)
	}
	if err := clientcmdapi.FlattenConfig(cfg); err != nil {
		return nil, fmt.Errorf("kubeconfig source %s: %w", s.Path, err)
	}
	if cfg.CurrentContext == "" {
		return nil, fmt.Errorf("kubeconfig source %s: no current-context", s.Path)
	}
	return writeConfig(cfg)
}

// Kubeconfig keeps the plugin's kubeconfig at Path (mode 0600) in step with Source.
type Kubeconfig struct {
	Source KubeconfigSource
	Path   string
}

// Install writes the kubeconfig when its content changed, and reports whether it wrote.
func (k *Kubeconfig) Install() (bool, error) {
	want, err := k.Source.Kubeconfig()
	if err != nil {
		return false, err
	}
	have, err := os.ReadFile(k.Path)
	if err == nil && bytes.Equal(have, want) {
		if fi, err := os.Stat(k.Path); err == nil && fi.Mode().Perm() == 0o600 {
			return false, nil
		}
	}
	if err := os.MkdirAll(filepath.Dir(k.Path), 0o755); err != nil {
		return false, fmt.Errorf("kubeconfig directory: %w", err)
	}
	if err := fileutil.WriteFileAtomic(k.Path, want, 0o600); err != nil {
		return false, fmt.Errorf("write kubeconfig: %w", err)
	}
	return true, nil
}

// Check returns nil when the kubeconfig at Path is what Source makes now, mode 0600.
func (k *Kubeconfig) Check() error {
	want, err := k.Source.Kubeconfig()
	if err != nil {
		return err
	}
	have, err := os.ReadFile(k.Path)
	if err != nil {
		return fmt.Errorf("plugin kubeconfig: %w", err)
	}
	if !bytes.Equal(have, want) {
		return fmt.Errorf("plugin kubeconfig %s is stale", k.Path)
	}
	fi, err := os.Stat(k.Path)
	if err != nil {
		return fmt.Errorf("plugin kubeconfig: %w", err)
	}
	if fi.Mode().Perm() != 0o600 {
		return fmt.Errorf("plugin kubeconfig %s has mode %v, want 0600", k.Path, fi.Mode().Perm())
	}
	return nil
}

// Remove deletes the kubeconfig; a missing file is no error.
func (k *Kubeconfig) Remove() error {
	if err := os.Remove(k.Path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove kubeconfig: %w", err)
	}
	return nil
}
