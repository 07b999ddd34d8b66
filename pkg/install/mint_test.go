package install

import (
	"context"
	"strings"
	"testing"
	"time"

	authv1 "k8s.io/api/authentication/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

// tokenServer is a fake API server's TokenRequest: it records each request and grants
// the lifetime granted (0: the one asked), or refuses a Node binding when noNodeBinding.
type tokenServer struct {
	granted       time.Duration
	noNodeBinding bool
	issued        time.Time
	asked         []authv1.TokenRequestSpec
}

func (s *tokenServer) client() *fake.Clientset {
	cs := fake.NewClientset()
	cs.PrependReactor("create", "serviceaccounts", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.GetSubresource() != "token" {
			return false, nil, nil
		}
		tr := a.(k8stesting.CreateAction).GetObject().(*authv1.TokenRequest)
		s.asked = append(s.asked, tr.Spec)
		if s.noNodeBinding && tr.Spec.BoundObjectRef != nil {
			return true, nil, apierrors.NewBadRequest("cannot bind token to a Node: feature disabled")
		}
		life := s.granted
		if life == 0 {
			life = time.Duration(*tr.Spec.ExpirationSeconds) * time.Second
		}
		return true, &authv1.TokenRequest{Status: authv1.TokenRequestStatus{Token: "tok", ExpirationTimestamp: metav1.NewTime(s.issued.Add(life))}}, nil
	})
	return cs
}

// TestTokenMinterBound: the minter asks for the configured lifetime, bound to its Node;
// a lifetime outside 10m–24h is refused before any request; a longer grant than asked is
// held (and so renewed) as the asked one; a server that cannot bind to a Node gets an
// unbound request.
func TestTokenMinterBound(t *testing.T) {
	issued := time.Now().Truncate(time.Second)
	for _, tc := range []struct {
		name          string
		ask, granted  time.Duration
		noNodeBinding bool
		wantErr       string
		wantExpiry    time.Duration // after issued
		wantBound     string
		wantRequests  int
	}{
		{name: "asked", ask: time.Hour, wantExpiry: time.Hour, wantBound: "Node/node-1", wantRequests: 1},
		{name: "minimum", ask: 10 * time.Minute, wantExpiry: 10 * time.Minute, wantBound: "Node/node-1", wantRequests: 1},
		{name: "maximum", ask: 24 * time.Hour, wantExpiry: 24 * time.Hour, wantBound: "Node/node-1", wantRequests: 1},
		{name: "granted less", ask: time.Hour, granted: 30 * time.Minute, wantExpiry: 30 * time.Minute, wantBound: "Node/node-1", wantRequests: 1},
		{name: "granted more", ask: time.Hour, granted: 48 * time.Hour, wantExpiry: time.Hour, wantBound: "Node/node-1", wantRequests: 1},
		{name: "too long", ask: 24*time.Hour + time.Second, wantErr: "want 10m0s to 24h0m0s"},
		{name: "a year", ask: 365 * 24 * time.Hour, wantErr: "want 10m0s to 24h0m0s"},
		{name: "too short", ask: 9 * time.Minute, wantErr: "want 10m0s to 24h0m0s"},
		{name: "no node binding", ask: time.Hour, noNodeBinding: true, wantExpiry: time.Hour, wantBound: "", wantRequests: 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := &tokenServer{granted: tc.granted, noNodeBinding: tc.noNodeBinding, issued: issued}
			m := &TokenMinter{Client: srv.client(), Namespace: "ns", ServiceAccount: "meshcni-plugin", NodeName: "node-1", Expiration: tc.ask}
			holder := &Minted{API: &InCluster{}}
			exp, err := m.Mint(context.Background(), holder, issued)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("Mint: %v, want an error naming %q", err, tc.wantErr)
				}
				if len(srv.asked) != 0 || !holder.Expires().IsZero() {
					t.Errorf("refused lifetime: %d requests sent, holder expiry %v", len(srv.asked), holder.Expires())
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := exp.Sub(issued); got != tc.wantExpiry || !holder.Expires().Equal(exp) {
				t.Errorf("expiry %v after issue (holder %v), want %v", got, holder.Expires().Sub(issued), tc.wantExpiry)
			}
			if len(srv.asked) != tc.wantRequests {
				t.Fatalf("%d requests, want %d", len(srv.asked), tc.wantRequests)
			}
			first, last := srv.asked[0], srv.asked[len(srv.asked)-1]
			if *last.ExpirationSeconds != int64(tc.ask/time.Second) {
				t.Errorf("asked %d s, want %v", *last.ExpirationSeconds, tc.ask)
			}
			if ref := first.BoundObjectRef; ref == nil || ref.Kind != "Node" || ref.APIVersion != "v1" || ref.Name != "node-1" {
				t.Errorf("first request bound to %+v, want Node node-1", ref)
			}
			if tc.noNodeBinding && last.BoundObjectRef != nil {
				t.Errorf("retry bound to %+v, want none", last.BoundObjectRef)
			}
			if m.Bound() != tc.wantBound {
				t.Errorf("Bound() %q, want %q", m.Bound(), tc.wantBound)
			}
		})
	}
}
