package agent

import (
	"context"
	"math/rand/v2"
	"time"

	"github.com/meshcni/meshcni/pkg/install"
)

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

// PluginToken keeps the plugin's credential: a token minted by install.TokenMinter
// (bound to the agent's Node), held in Holder and renewed before it expires. A failed
// renewal is retried with backoff while the current token stays in use; once it has
// expired, Holder's kubeconfig fails and the agent reports unready.
type PluginToken struct {
	install.TokenMinter
	Holder *install.Minted
	// Changed is called after a new token is held (the guard rewrites the kubeconfig).
	Changed func()
	Metrics *Metrics

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
	p.Log.Info("plugin token minted", "service_account", p.Namespace+"/"+p.ServiceAccount, "bound", p.Bound(),
		"expires", exp.UTC(), "lifetime", exp.Sub(issued).Round(time.Second), "renew_in", wait.Round(time.Second))
	return wait
}

// Mint requests a token, holds it and returns its expiry (what the API server granted,
// at most Expiration from now).
func (p *PluginToken) Mint(ctx context.Context) (time.Time, error) {
	if p.now == nil {
		p.now = time.Now
	}
	ctx, cancel := context.WithTimeout(ctx, mintTimeout)
	defer cancel()
	exp, err := p.TokenMinter.Mint(ctx, p.Holder, p.now())
	if err != nil {
		return time.Time{}, err
	}
	if p.Metrics != nil {
		p.Metrics.TokenExpiry.Set(float64(exp.Unix()))
	}
	if p.Changed != nil {
		p.Changed()
	}
	return exp, nil
}
