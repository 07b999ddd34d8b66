package agent

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strings"
	"time"

	authv1 "k8s.io/api/authentication/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/meshcni/meshcni/pkg/install"
)

// MinTokenExpiration is the shortest lifetime the API server grants a TokenRequest.
const MinTokenExpiration = 10 * time.Minute

// Renewal timing of the plugin's token.
const (
	renewAt       = 0.8 // of the granted lifetime, minus up to renewJitter of it
	renewJitter   = 0.1 // so the agents of a cluster do not renew in step
	retryFirst    = time.Second
	retryMax      = time.Minute
	mintTimeout   = 30 * time.Second
	minRenewAfter = time.Second
)

// RenewAfter is how long after issued a token valid until expires is renewed: between
// 70 % and 80 % of its lifetime (r in [0, 1) picks where), at least a second.
func RenewAfter(issued, expires time.Time, r float64) time.Duration {
	life := expires.Sub(issued)
	d := time.Duration(float64(life) * (renewAt - renewJitter*r))
	return max(d, minRenewAfter)
}

// RetryAfter is the wait before the attempt-th retry of a failed renewal (attempt ≥ 1):
// 1 s doubling up to 1 min, times 0.8–1.2 (r in [0, 1)).
func RetryAfter(attempt int, r float64) time.Duration {
	d := retryFirst
	for i := 1; i < attempt && d < retryMax; i++ {
		d *= 2
	}
	d = min(d, retryMax)
	return time.Duration(float64(d) * (0.8 + 0.4*r))
}

// PluginToken keeps the plugin's credential: a token of ServiceAccount
// Namespace/ServiceAccount minted through the TokenRequest API, bound to the agent's
// Node (the API server refuses to bind a token of one ServiceAccount to a Pod running as
// another; a Node-bound token names the node, as the agent's own pod-bound token does,
// and dies with the Node object), held in Holder and renewed before it expires. A
// failed renewal is retried with backoff while the current token stays in use; once it
// has expired, Holder's kubeconfig fails and the agent reports unready.
type PluginToken struct {
	Client         kubernetes.Interface // the agent's own client
	Namespace      string               // the agent's and the plugin ServiceAccount's namespace
	ServiceAccount string
	NodeName       string // the agent's node, the token's bound object
	Expiration     time.Duration
	Holder         *install.Minted
	// Changed is called after a new token is held (the guard rewrites the kubeconfig).
	Changed func()
	Log     *slog.Logger
	Metrics *Metrics

	// unbound: the API server refused the Node binding (Kubernetes before 1.31, or the
	// feature gate ServiceAccountTokenNodeBinding off); later tokens are asked unbound.
	unbound bool

	// Test hooks: the clock, the timer and the jitter source.
	now   func() time.Time
	after func(time.Duration) <-chan time.Time
	rand  func() float64
}

// Name implements Runnable.
func (p *PluginToken) Name() string { return "plugin-token" }

func (p *PluginToken) defaults() {
	if p.now == nil {
		p.now = time.Now
	}
	if p.after == nil {
		p.after = time.After
	}
	if p.rand == nil {
		p.rand = rand.Float64
	}
}

// Run mints the first token at once, then renews it until ctx ends. It never fails the
// agent: an API error is retried (and reported by the log, the metrics and, once the
// token has expired, readiness).
func (p *PluginToken) Run(ctx context.Context) error {
	p.defaults()
	attempt := 0
	for {
		wait := p.renew(ctx, &attempt)
		select {
		case <-ctx.Done():
			return nil
		case <-p.after(wait):
		}
	}
}

// renew mints a token and returns the wait before the next attempt.
func (p *PluginToken) renew(ctx context.Context, attempt *int) time.Duration {
	issued := p.now()
	exp, err := p.Mint(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return 0
		}
		*attempt++
		p.Holder.SetError(err)
		p.Metrics.TokenRenewals.WithLabelValues("error").Inc()
		wait := RetryAfter(*attempt, p.rand())
		args := []any{"service_account", p.Namespace + "/" + p.ServiceAccount, "err", err, "attempt", *attempt, "retry_in", wait}
		if old := p.Holder.Expires(); !old.IsZero() {
			args = append(args, "current_token_expires", old.UTC())
		}
		p.Log.Warn("cannot mint the plugin's token; the current one (if any) stays in use until it expires", args...)
		return wait
	}
	*attempt = 0
	p.Metrics.TokenRenewals.WithLabelValues("success").Inc()
	wait := RenewAfter(issued, exp, p.rand())
	p.Log.Info("plugin token minted", "service_account", p.Namespace+"/"+p.ServiceAccount, "bound_node", p.NodeName,
		"expires", exp.UTC(), "lifetime", exp.Sub(issued).Round(time.Second), "renew_in", wait.Round(time.Second))
	return wait
}

// Mint requests a token, holds it and returns its expiry (what the API server granted,
// which may be shorter than Expiration).
func (p *PluginToken) Mint(ctx context.Context) (time.Time, error) {
	ctx, cancel := context.WithTimeout(ctx, mintTimeout)
	defer cancel()
	out, err := p.request(ctx)
	if err != nil {
		return time.Time{}, fmt.Errorf("TokenRequest for ServiceAccount %s/%s: %w", p.Namespace, p.ServiceAccount, err)
	}
	exp := out.Status.ExpirationTimestamp.Time
	if err := p.Holder.SetToken(out.Status.Token, exp); err != nil {
		return time.Time{}, fmt.Errorf("TokenRequest for ServiceAccount %s/%s: %w", p.Namespace, p.ServiceAccount, err)
	}
	if p.Metrics != nil {
		p.Metrics.TokenExpiry.Set(float64(exp.Unix()))
	}
	if p.Changed != nil {
		p.Changed()
	}
	return exp, nil
}

// request asks for a token bound to the node; where the API server cannot bind a token
// to a Node, for an unbound one (it still expires).
func (p *PluginToken) request(ctx context.Context) (*authv1.TokenRequest, error) {
	secs := int64(p.Expiration / time.Second)
	tr := &authv1.TokenRequest{Spec: authv1.TokenRequestSpec{ExpirationSeconds: &secs}}
	if !p.unbound {
		tr.Spec.BoundObjectRef = &authv1.BoundObjectReference{Kind: "Node", APIVersion: "v1", Name: p.NodeName}
	}
	sas := p.Client.CoreV1().ServiceAccounts(p.Namespace)
	out, err := sas.CreateToken(ctx, p.ServiceAccount, tr, metav1.CreateOptions{})
	if err != nil && !p.unbound && apierrors.IsBadRequest(err) && strings.Contains(err.Error(), "cannot bind token to") {
		p.unbound = true
		if p.Log != nil {
			p.Log.Warn("the API server cannot bind a token to a Node (Kubernetes before 1.31, or ServiceAccountTokenNodeBinding off): the plugin's token is bound to no object and lives until it expires", "err", err)
		}
		tr.Spec.BoundObjectRef = nil
		out, err = sas.CreateToken(ctx, p.ServiceAccount, tr, metav1.CreateOptions{})
	}
	if err != nil {
		return nil, err
	}
	return out, nil
}
