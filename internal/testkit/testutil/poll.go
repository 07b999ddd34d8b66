package testutil

import (
	"context"
	"testing"
	"time"
)

// PollUntil calls f every `every` until it returns nil, and returns the time it did;
// when d passes (or ctx ends) first it fails the test with what and f's last error.
func PollUntil(ctx context.Context, t testing.TB, d, every time.Duration, what string, f func() error) time.Time {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	for {
		err := f()
		if err == nil {
			return time.Now()
		}
		select {
		case <-ctx.Done():
			t.Fatalf("%s: not within %v: %v", what, d, err)
		case <-time.After(every):
		}
	}
}
