package nftables

import (
	"context"
	"fmt"

	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/rules"
)

// Check compares meshcni's live tables with the ruleset. Each drift entry reads
// "<table> <chain>: <rule>", with the renderer's text for missing rules and the
// decompiled live text for unexpected ones.
func (b *Backend) Check(ctx context.Context, netnsPath string, rs *rules.Ruleset) (backend.Drift, error) {
	var d backend.Drift
	if err := ctx.Err(); err != nil {
		return d, err
	}
	desired, err := b.compile(rs)
	if err != nil {
		return d, fmt.Errorf("nftables check: %w", err)
	}
	c, closeConn, err := Dial(netnsPath, nil)
	if err != nil {
		return d, fmt.Errorf("nftables check: %w", err)
	}
	defer closeConn()
	live, err := readLive(c)
	if err != nil {
		return d, fmt.Errorf("nftables check in netns %q: %w", netnsPath, err)
	}
	liveChains := map[string]liveChain{}
	for _, lt := range live {
		for _, lc := range lt.chains {
			liveChains[lt.name+" "+lc.name] = lc
		}
	}
	seen := map[string]bool{}
	for _, dt := range desired {
		for _, dc := range dt.chains {
			id := dt.name + " " + dc.name
			seen[id] = true
			lc, ok := liveChains[id]
			if want := chainDef(dc.base); !ok || lc.def != want {
				if want != "" || !ok {
					d.Missing = append(d.Missing, fmt.Sprintf("%s: chain %s", id, orRegular(want)))
				}
				if ok {
					d.Unexpected = append(d.Unexpected, fmt.Sprintf("%s: chain %s", id, orRegular(lc.def)))
				}
			}
			want := make([]string, len(dc.rules))
			for i, cr := range dc.rules {
				want[i] = desiredKey(cr)
			}
			got := make([]string, len(lc.rules))
			for i, r := range lc.rules {
				got[i] = r.key
			}
			miss, extra := diffSeq(want, got)
			for _, i := range miss {
				d.Missing = append(d.Missing, fmt.Sprintf("%s: %s", id, dc.rules[i].text))
			}
			for _, i := range extra {
				d.Unexpected = append(d.Unexpected, fmt.Sprintf("%s: %s", id, lc.rules[i].text))
			}
		}
	}
	for _, lt := range live {
		for _, lc := range lt.chains {
			id := lt.name + " " + lc.name
			if seen[id] {
				continue
			}
			d.Unexpected = append(d.Unexpected, fmt.Sprintf("%s: chain %s", id, orRegular(lc.def)))
			for _, r := range lc.rules {
				d.Unexpected = append(d.Unexpected, fmt.Sprintf("%s: %s", id, r.text))
			}
		}
	}
	return d, nil
}

func orRegular(def string) string {
	if def == "" {
		return "(regular)"
	}
	return "{ " + def + " }"
}

// diffSeq returns the indexes of want and got outside a longest common subsequence:
// the missing and the unexpected entries, order kept.
func diffSeq(want, got []string) (missing, unexpected []int) {
	n, m := len(want), len(got)
	l := make([][]int, n+1)
	for i := range l {
		l[i] = make([]int, m+1)
	}
	for i := n - 1; i >= 0; i-- {
		for j := m - 1; j >= 0; j-- {
			if want[i] == got[j] {
				l[i][j] = l[i+1][j+1] + 1
			} else {
				l[i][j] = max(l[i+1][j], l[i][j+1])
			}
		}
	}
	i, j := 0, 0
	for i < n && j < m {
		switch {
		case want[i] == got[j]:
			i, j = i+1, j+1
		case l[i+1][j] >= l[i][j+1]:
			missing = append(missing, i)
			i++
		default:
			unexpected = append(unexpected, j)
			j++
		}
	}
	for ; i < n; i++ {
		missing = append(missing, i)
	}
	for ; j < m; j++ {
		unexpected = append(unexpected, j)
	}
	return missing, unexpected
}
