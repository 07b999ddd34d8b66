package install

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"time"

	authv1 "k8s.io/api/authentication/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// The lifetimes a plugin token may be asked for: the API server's minimum for a
// TokenRequest, and the longest a stolen copy of the plugin's kubeconfig stays valid.
const (
	MinTokenExpiration = 10 * time.Minute
	MaxTokenExpiration = 24 * time.Hour
)

// CheckTokenExpiration reports whether d is a lifetime Mint may ask for.
func CheckTokenExpiration(d time.Duration) error {
	if d < MinTokenExpiration || d > MaxTokenExpiration {
		return fmt.Errorf("token lifetime %v: want %v to %v", d, MinTokenExpiration, MaxTokenExpiration)
	}
	return nil
}

// TokenMinter mints the plugin's credential: a token of ServiceAccount
// Namespace/ServiceAccount through the TokenRequest API, bound to the Node NodeName (the
// API server binds a token to a Pod only for that Pod's own ServiceAccount; a Node-bound
// token names the node, as the agent's own pod-bound token does, and dies with the Node
// object), asked for Expiration. Where the API server cannot bind a token to a Node
// (Kubernetes before 1.31, or the feature gate ServiceAccountTokenNodeBinding off), it
// asks for an unbound token instead, which still expires.
type TokenMinter struct {
	Client         kubernetes.Interface // the minter's own client (the agent's)
	Namespace      string               // the plugin ServiceAccount's namespace
	ServiceAccount string
	NodeName       string // the token's bound object
	Expiration     time.Duration
	Log            *slog.Logger

	// unbound: the API server refused the Node binding; later tokens are asked unbound.
	unbound bool
}

// Mint requests a token and holds it in holder until its expiry, which it returns: what
// the API server granted, and never later than Expiration after issued (a longer grant
// is renewed as if it were Expiration long).
func (m *TokenMinter) Mint(ctx context.Context, holder *Minted, issued time.Time) (time.Time, error) {
	if err := CheckTokenExpiration(m.Expiration); err != nil {
		return time.Time{}, fmt.Errorf("TokenRequest for ServiceAccount %s/%s: %w", m.Namespace, m.ServiceAccount, err)
	}
	out, err := m.request(ctx)
	if err != nil {
		return time.Time{}, fmt.Errorf("TokenRequest for ServiceAccount %s/%s: %w", m.Namespace, m.ServiceAccount, err)
	}
	exp := out.Status.ExpirationTimestamp.Time
	if limit := issued.Add(m.Expiration); exp.After(limit) {
		m.log().Info("the API server granted the plugin's token a longer lifetime than asked; it is renewed as if it were the asked one",
			"service_account", m.Namespace+"/"+m.ServiceAccount, "granted_expiry", exp.UTC(), "asked", m.Expiration)
		exp = limit
	}
	if err := holder.SetToken(out.Status.Token, exp); err != nil {
		return time.Time{}, fmt.Errorf("TokenRequest for ServiceAccount %s/%s: %w", m.Namespace, m.ServiceAccount, err)
	}
	return exp, nil
}

// Bound is the token's bound object as the last request asked it: "Node/<name>", or ""
// for an unbound token.
func (m *TokenMinter) Bound() string {
	if m.unbound {
		return ""
	}
	return "Node/" + m.NodeName
}

func (m *TokenMinter) log() *slog.Logger {
	if m.Log == nil {
		return slog.New(slog.DiscardHandler)
	}
	return m.Log
}

// request asks for a token bound to the node; where the API server cannot bind a token
// to a Node, for an unbound one.
func (m *TokenMinter) request(ctx context.Context) (*authv1.TokenRequest, error) {
	secs := int64(m.Expiration / time.Second)
	tr := &authv1.TokenRequest{Spec: authv1.TokenRequestSpec{ExpirationSeconds: &secs}}
	if !m.unbound {
		tr.Spec.BoundObjectRef = &authv1.BoundObjectReference{Kind: "Node", APIVersion: "v1", Name: m.NodeName}
	}
	sas := m.Client.CoreV1().ServiceAccounts(m.Namespace)
	out, err := sas.CreateToken(ctx, m.ServiceAccount, tr, metav1.CreateOptions{})
	if err != nil && !m.unbound && apierrors.IsBadRequest(err) && strings.Contains(err.Error(), "cannot bind token to") {
		m.unbound = true
		m.log().Warn("the API server cannot bind a token to a Node (Kubernetes before 1.31, or ServiceAccountTokenNodeBinding off): the plugin's token is bound to no object and lives until it expires", "err", err)
		tr.Spec.BoundObjectRef = nil
		out, err = sas.CreateToken(ctx, m.ServiceAccount, tr, metav1.CreateOptions{})
	}
	if err != nil {
		return nil, err
	}
	return out, nil
}
