package nftables

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// groupResolver turns group names into GIDs by reading a group(5) file, only when a
// name (not a decimal GID) is used, and at most once. There is no NSS and no cgo:
// names from LDAP or other NSS sources are not found, which is reported as an error.
type groupResolver struct {
	path   string
	loaded bool
	byName map[string]uint32
}

func (g *groupResolver) gid(group string) (uint32, error) {
	if n, err := strconv.ParseUint(group, 10, 32); err == nil {
		return uint32(n), nil
	}
	if !g.loaded {
		data, err := os.ReadFile(g.path)
		if err != nil {
			return 0, fmt.Errorf("group %q: %w", group, err)
		}
		m, err := parseGroups(data)
		if err != nil {
			return 0, fmt.Errorf("group %q: %s: %w", group, g.path, err)
		}
		g.byName, g.loaded = m, true
	}
	gid, ok := g.byName[group]
	if !ok {
		return 0, fmt.Errorf("group %q: no such group in %s", group, g.path)
	}
	return gid, nil
}

// parseGroups reads group(5) lines: name:password:GID:members. Comments and blank
// lines, and NIS compat entries (+/-), are skipped; the first entry of a name wins, as getgrnam does.
func parseGroups(data []byte) (map[string]uint32, error) {
	out := map[string]uint32{}
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 0, 64*1024), 1<<20)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") || strings.HasPrefix(line, "+") || strings.HasPrefix(line, "-") {
			continue
		}
		f := strings.Split(line, ":")
		if len(f) < 3 {
			return nil, fmt.Errorf("line %d: want name:password:GID[:members]", n)
		}
		gid, err := strconv.ParseUint(f[2], 10, 32)
		if err != nil {
			return nil, fmt.Errorf("line %d: GID %q: %w", n, f[2], err)
		}
		if _, dup := out[f[0]]; !dup {
			out[f[0]] = uint32(gid)
		}
	}
	return out, sc.Err()
}
