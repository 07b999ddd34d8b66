package testbed

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// pki is the generated certificate authority and the files derived from it.
type pki struct {
	caCert *x509.Certificate
	caKey  *ecdsa.PrivateKey
	caPEM  []byte
}

type certSpec struct {
	file   string // base name: <file>.crt and <file>.key in pkiDir
	cn     string
	orgs   []string
	ips    []string
	dns    []string
	server bool
	client bool
}

func writePEM(path, typ string, der []byte, mode os.FileMode) error {
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), mode)
}

func newSerial() *big.Int {
	n, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	return n
}

// generatePKI writes the CA, the component certificates, the service-account key
// pair and the kubeconfigs into pkiDir and BaseDir.
func generatePKI() (*pki, error) {
	if err := os.MkdirAll(pkiDir, 0o700); err != nil {
		return nil, err
	}
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	now := time.Now().Add(-time.Hour)
	caTmpl := &x509.Certificate{
		SerialNumber:          newSerial(),
		Subject:               pkix.Name{CommonName: "meshcni-testbed-ca"},
		NotBefore:             now,
		NotAfter:              now.Add(10 * 365 * 24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return nil, fmt.Errorf("create CA: %w", err)
	}
	caCert, err := x509.ParseCertificate(caDER)
	if err != nil {
		return nil, err
	}
	p := &pki{caCert: caCert, caKey: caKey, caPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER})}
	if err := os.WriteFile(filepath.Join(pkiDir, "ca.crt"), p.caPEM, 0o644); err != nil {
		return nil, err
	}
	caKeyDER, err := x509.MarshalECPrivateKey(caKey)
	if err != nil {
		return nil, err
	}
	if err := writePEM(filepath.Join(pkiDir, "ca.key"), "EC PRIVATE KEY", caKeyDER, 0o600); err != nil {
		return nil, err
	}

	specs := []certSpec{
		{file: "apiserver", cn: "kube-apiserver", server: true,
			ips: []string{"127.0.0.1", firstServiceIP(), NodeIP},
			dns: []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"}},
		{file: "apiserver-kubelet-client", cn: "kube-apiserver-kubelet-client", orgs: []string{"system:masters"}, client: true},
		{file: "admin", cn: "meshcni-testbed-admin", orgs: []string{"system:masters"}, client: true},
		{file: "kubelet", cn: "system:node:" + NodeName, orgs: []string{"system:nodes"}, client: true},
		{file: "kubelet-serving", cn: NodeName, server: true, ips: []string{NodeIP, "127.0.0.1"}, dns: []string{NodeName, "localhost"}},
		// system:masters + no per-controller ServiceAccount credentials: minting a
		// token per controller would lengthen every start by seconds.
		{file: "controller-manager", cn: "system:kube-controller-manager", orgs: []string{"system:masters"}, client: true},
		{file: "scheduler", cn: "system:kube-scheduler", client: true},
	}
	for _, s := range specs {
		if err := p.issue(s); err != nil {
			return nil, fmt.Errorf("issue %s certificate: %w", s.file, err)
		}
	}

	saKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	saDER, err := x509.MarshalPKCS8PrivateKey(saKey)
	if err != nil {
		return nil, err
	}
	if err := writePEM(filepath.Join(pkiDir, "sa.key"), "PRIVATE KEY", saDER, 0o600); err != nil {
		return nil, err
	}
	saPub, err := x509.MarshalPKIXPublicKey(&saKey.PublicKey)
	if err != nil {
		return nil, err
	}
	if err := writePEM(filepath.Join(pkiDir, "sa.pub"), "PUBLIC KEY", saPub, 0o644); err != nil {
		return nil, err
	}

	for _, kc := range []struct{ path, cert string }{
		{adminKubeconfig, "admin"},
		{filepath.Join(BaseDir, "kubelet.kubeconfig"), "kubelet"},
		{filepath.Join(BaseDir, "controller-manager.kubeconfig"), "controller-manager"},
		{filepath.Join(BaseDir, "scheduler.kubeconfig"), "scheduler"},
	} {
		if err := p.writeKubeconfig(kc.path, kc.cert); err != nil {
			return nil, fmt.Errorf("kubeconfig %s: %w", kc.path, err)
		}
	}
	return p, nil
}

func firstServiceIP() string {
	_, n, _ := net.ParseCIDR(ServiceCIDR)
	ip := n.IP.To4()
	return net.IPv4(ip[0], ip[1], ip[2], ip[3]+1).String()
}

func (p *pki) issue(s certSpec) error { return p.issueIn(pkiDir, s) }

// issueIn writes the certificate s and its key into dir.
func (p *pki) issueIn(dir string, s certSpec) error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	now := time.Now().Add(-time.Hour)
	tmpl := &x509.Certificate{
		SerialNumber: newSerial(),
		Subject:      pkix.Name{CommonName: s.cn, Organization: s.orgs},
		NotBefore:    now,
		NotAfter:     now.Add(10 * 365 * 24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		DNSNames:     s.dns,
	}
	for _, ip := range s.ips {
		tmpl.IPAddresses = append(tmpl.IPAddresses, net.ParseIP(ip))
	}
	if s.server {
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageServerAuth)
	}
	if s.client {
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageClientAuth)
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.caCert, &key.PublicKey, p.caKey)
	if err != nil {
		return err
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return err
	}
	if err := writePEM(filepath.Join(dir, s.file+".crt"), "CERTIFICATE", der, 0o644); err != nil {
		return err
	}
	return writePEM(filepath.Join(dir, s.file+".key"), "EC PRIVATE KEY", keyDER, 0o600)
}

func (p *pki) writeKubeconfig(path, cert string) error {
	return p.writeKubeconfigFor(path, pkiDir, cert, APIServerHost)
}

// writeKubeconfigFor writes a kubeconfig for the certificate cert of dir that
// reaches the API server at host.
func (p *pki) writeKubeconfigFor(path, dir, cert, host string) error {
	crt, err := os.ReadFile(filepath.Join(dir, cert+".crt"))
	if err != nil {
		return err
	}
	key, err := os.ReadFile(filepath.Join(dir, cert+".key"))
	if err != nil {
		return err
	}
	b64 := base64.StdEncoding.EncodeToString
	kc := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: meshcni-testbed
  cluster:
    server: https://%s:%d
    certificate-authority-data: %s
users:
- name: %s
  user:
    client-certificate-data: %s
    client-key-data: %s
contexts:
- name: meshcni-testbed
  context:
    cluster: meshcni-testbed
    user: %s
current-context: meshcni-testbed
`, host, APIServerPort, b64(p.caPEM), cert, b64(crt), b64(key), cert)
	return os.WriteFile(path, []byte(kc), 0o600)
}

// loadPKI reads the running test bed's certificate authority.
func loadPKI() (*pki, error) {
	caPEM, err := os.ReadFile(pkiPath("ca.crt"))
	if err != nil {
		return nil, err
	}
	keyPEM, err := os.ReadFile(pkiPath("ca.key"))
	if err != nil {
		return nil, err
	}
	cb, _ := pem.Decode(caPEM)
	kb, _ := pem.Decode(keyPEM)
	if cb == nil || kb == nil {
		return nil, fmt.Errorf("%s: not PEM", pkiDir)
	}
	cert, err := x509.ParseCertificate(cb.Bytes)
	if err != nil {
		return nil, fmt.Errorf("parse CA certificate: %w", err)
	}
	key, err := x509.ParseECPrivateKey(kb.Bytes)
	if err != nil {
		return nil, fmt.Errorf("parse CA key: %w", err)
	}
	return &pki{caCert: cert, caKey: key, caPEM: caPEM}, nil
}

func pkiPath(name string) string { return filepath.Join(pkiDir, name) }
