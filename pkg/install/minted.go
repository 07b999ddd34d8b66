package install

import (
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"time"
)

// ErrNoToken: no token has been set yet (the first TokenRequest has not answered).
var ErrNoToken = errors.New("the plugin's token is not minted yet")

// Minted builds the plugin's kubeconfig from a token held in memory, set by whoever
// mints it (the agent, through the TokenRequest API), and the CA and API server address
// of API. The kubeconfig stops being valid when the token expires: Kubeconfig then
// returns an error, so a kubeconfig check (the agent's readiness) fails instead of
// passing with a dead credential.
type Minted struct {
	API *InCluster // the CA file and the server address; its token file is not read
	// Now is the clock (default time.Now).
	Now func() time.Time

	mu      sync.Mutex
	token   string
	expires time.Time
	lastErr string // why the last renewal failed, for the expired error
}

// SetToken holds a new token valid until expires.
func (s *Minted) SetToken(token string, expires time.Time) error {
	token = strings.TrimSpace(token)
	if token == "" || strings.ContainsAny(token, " \t\r\n") {
		return errors.New("minted token is empty or malformed")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.token, s.expires, s.lastErr = token, expires, ""
	return nil
}

// SetError notes why a renewal failed; the expired error names it.
func (s *Minted) SetError(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.lastErr = err.Error()
}

// Expires is the current token's expiry (zero: no token).
func (s *Minted) Expires() time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.expires
}

// WatchDirs is the CA's directory: a rotated CA changes the kubeconfig.
func (s *Minted) WatchDirs() []string { return []string{filepath.Dir(s.API.CAFile)} }

// Kubeconfig builds the kubeconfig with the current token; ErrNoToken before the first
// one, an error once it has expired.
func (s *Minted) Kubeconfig() ([]byte, error) {
	now := time.Now
	if s.Now != nil {
		now = s.Now
	}
	s.mu.Lock()
	tok, exp, why := s.token, s.expires, s.lastErr
	s.mu.Unlock()
	if tok == "" {
		return nil, ErrNoToken
	}
	if !now().Before(exp) {
		if why == "" {
			why = "no renewal answered yet"
		}
		return nil, fmt.Errorf("the plugin's token expired at %s and was not renewed (last error: %s)", exp.UTC().Format(time.RFC3339), why)
	}
	return s.API.withToken(tok)
}
