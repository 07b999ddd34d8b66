// Package nftables is meshcni's native nftables backend: it writes, compares and
// removes meshcni's rules in a network namespace over netlink (github.com/google/nftables),
// without executing any program.
//
// It writes the inet view of the ruleset (rules.Ruleset.Resolve(rules.Both)) into
// three inet tables, istio-proxy-nat, istio-proxy-mangle and istio-proxy-raw, with the
// chains and statements that pkg/rules/nft renders as text, expression for expression
// (the two share nft.Statements), so that `nft list ruleset` reads the same whichever
// path wrote the rules.
//
// API:
//
//	b := nftables.New()                          // reads /etc/group for group names
//	err := b.Apply(ctx, "/run/netns/pod", rs)    // one atomic netlink batch
//	drift, err := b.Check(ctx, "/run/netns/pod", rs)
//	text, err := b.Live(ctx, "/run/netns/pod")   // meshcni's live rules, nft-like text
//	err = b.Clean(ctx, "/run/netns/pod")         // delete the three tables, nothing else
//
// A netns path "" means the caller's current network namespace. Apply, Check and
// Live enter the namespace by passing its file descriptor to the netlink socket
// (the calling thread never switches namespace); Clean opens its socket there
// (netnsutil.Do) and lists and deletes over pkg/netlink, as the engine's Clean
// (backend auto) does with the same CleanTables.
//
// Apply takes the namespace's table listing from its caller (Backend.Listed: the
// engine's auto probe has just made it) or lists the tables over pkg/netlink, then
// sends one batch, committed by the kernel as one
// transaction: each of the three tables that is present is added (so the delete cannot
// fail) and deleted (so no stale chain or rule survives); the tables the ruleset needs
// are created exclusively with their chains, anonymous sets and rules. On any error
// nothing changes. Applying twice equals applying once.
//
// Group names in owner matches are resolved to GIDs by reading /etc/group (Backend's
// GroupFile), only when a name is used; an unknown name is an error naming it.
package nftables

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	gnft "github.com/google/nftables"
	mdnl "github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"

	"github.com/meshcni/meshcni/pkg/backend"
	"github.com/meshcni/meshcni/pkg/netlink"
	"github.com/meshcni/meshcni/pkg/netnsutil"
	"github.com/meshcni/meshcni/pkg/rules"
	"github.com/meshcni/meshcni/pkg/rules/nft"
)

// Backend is the native nftables backend. The zero value is not ready; use New.
type Backend struct {
	// GroupFile is the group(5) file group names are resolved from.
	GroupFile string
	// Log receives debug records of what was applied (slog.Default() if nil).
	Log *slog.Logger
	// OnSocket, when set, is called with every nfnetlink socket Apply and Clean open,
	// before it is used (pkg/engine keeps a duplicate of it, whose last close it then
	// controls).
	OnSocket func(fd int)
	// Listed, when not nil, is the namespace's nftables tables as the caller has just
	// listed them (pkg/engine's probe, netlink.ListTables): the next Apply replaces
	// meshcni's tables among them instead of listing again (it lists again only when
	// a table appeared since). Apply clears it.
	Listed []netlink.Table
}

var _ backend.Backend = (*Backend)(nil)

// New returns a backend resolving group names from /etc/group.
func New() *Backend { return &Backend{GroupFile: "/etc/group"} }

// Kind is backend.Nftables.
func (b *Backend) Kind() backend.Kind { return backend.Nftables }

func (b *Backend) log() *slog.Logger {
	if b.Log != nil {
		return b.Log
	}
	return slog.Default()
}

func (b *Backend) groupFile() string {
	if b.GroupFile != "" {
		return b.GroupFile
	}
	return "/etc/group"
}

// Dial opens a lasting netlink connection into the namespace at netnsPath ("" = the
// current one) by file descriptor (netnsutil.Open): the calling thread never
// switches namespace (on a thread locked into the namespace every wait on the
// socket would cost a thread hand-off). onSocket (nil: none) is called with its
// socket. close must be called when done.
func Dial(netnsPath string, onSocket func(fd int)) (c *gnft.Conn, close func(), err error) {
	opts := []gnft.ConnOption{gnft.AsLasting(), gnft.WithSockOptions(func(c *mdnl.Conn) error {
		rc, err := c.SyscallConn()
		if err != nil {
			return nil // best effort: default buffers, and the socket closes as usual
		}
		_ = rc.Control(func(fd uintptr) {
			sizeBuffers(int(fd))
			if onSocket != nil {
				onSocket(int(fd))
			}
		})
		return nil
	})}
	fd := -1
	if netnsPath != "" {
		if fd, err = netnsutil.Open(netnsPath); err != nil {
			return nil, nil, err
		}
		opts = append(opts, gnft.WithNetNSFd(fd))
	}
	c, err = gnft.New(opts...)
	if err != nil {
		if fd >= 0 {
			unix.Close(fd)
		}
		return nil, nil, fmt.Errorf("netlink in netns %q: %w", netnsPath, err)
	}
	return c, func() {
		_ = c.CloseLasting()
		if fd >= 0 {
			unix.Close(fd)
		}
	}, nil
}

// desiredChain is one chain to write: its definition and compiled rules.
type desiredChain struct {
	model string
	name  string
	base  *nft.BaseChain
	rules []compiledRule
}

type desiredTable struct {
	model  string
	name   string
	chains []desiredChain
}

// compile translates the ruleset's inet view into expressions. Errors name the
// table, chain and rule.
func (b *Backend) compile(rs *rules.Ruleset) ([]desiredTable, error) {
	c := &compiler{groups: &groupResolver{path: b.groupFile()}}
	var out []desiredTable
	for _, t := range nft.Resolve(rs) {
		dt := desiredTable{model: t.Model, name: t.Name}
		for _, ch := range t.Chains {
			dc := desiredChain{model: ch.Name, name: nft.ChainName(ch.Name)}
			if bc, ok := nft.Base(t.Model, ch.Name); ok {
				dc.base = &bc
			}
			for i, r := range ch.Rules {
				cr, err := c.rule(t.Model, ch.Name, r)
				if err != nil {
					return nil, fmt.Errorf("table %s chain %s rule %d (%s): %w", t.Name, dc.name, i+1, nft.RuleText(t.Model, ch.Name, r), err)
				}
				dc.rules = append(dc.rules, cr)
			}
			dt.chains = append(dt.chains, dc)
		}
		out = append(out, dt)
	}
	return out, nil
}

func inetTable(name string) *gnft.Table {
	return &gnft.Table{Name: name, Family: gnft.TableFamilyINet}
}

var chainTypes = map[string]gnft.ChainType{"nat": gnft.ChainTypeNAT, "filter": gnft.ChainTypeFilter, "route": gnft.ChainTypeRoute}
var chainHooks = map[string]*gnft.ChainHook{"prerouting": gnft.ChainHookPrerouting, "output": gnft.ChainHookOutput}

// Apply replaces meshcni's tables in the namespace with the ruleset, atomically.
func (b *Backend) Apply(ctx context.Context, netnsPath string, rs *rules.Ruleset) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	start := time.Now()
	tables, err := b.compile(rs)
	if err != nil {
		return fmt.Errorf("nftables apply: %w", err)
	}
	c, closeConn, err := Dial(netnsPath, b.OnSocket)
	if err != nil {
		return fmt.Errorf("nftables apply: %w", err)
	}
	defer closeConn()
	listed, haveListed := b.Listed, b.Listed != nil
	if haveListed {
		b.Listed = nil // the listing serves one batch (a Backend without one is never written to)
	}
	nrules := 0
	for attempt := 1; ; attempt++ {
		if !haveListed {
			if listed, err = listTables(netnsPath, b.OnSocket); err != nil {
				return fmt.Errorf("nftables apply in netns %q: %w", netnsPath, err)
			}
		}
		haveListed = false
		nrules, err = b.send(c, listed, tables)
		if err == nil {
			break
		}
		// A table created by someone else between the listing and our batch makes the
		// exclusive create fail (and the whole batch with it): list again, once.
		if errors.Is(err, unix.EEXIST) && attempt < 2 {
			continue
		}
		return b.afterFailedSend(ctx, netnsPath, rs, len(tables), nrules, err)
	}
	b.log().Debug("nftables ruleset applied", "netns", netnsPath, "tables", len(tables), "rules", nrules, "duration", time.Since(start))
	return nil
}

// afterFailedSend reads the namespace back after a failed batch and says what it
// holds: the batch is one transaction, so the namespace holds either the whole new
// ruleset (the error came after the commit, e.g. while reading acknowledgements:
// the apply succeeded) or what it held before ("nothing was changed" is then true).
func (b *Backend) afterFailedSend(ctx context.Context, netnsPath string, rs *rules.Ruleset, ntables, nrules int, sendErr error) error {
	d, err := b.Check(ctx, netnsPath, rs)
	switch {
	case err != nil:
		return fmt.Errorf("nftables apply in netns %q (%d tables, %d rules): %w; reading the namespace back failed too, its state is unknown: %v", netnsPath, ntables, nrules, sendErr, err)
	case d.Empty():
		b.log().Warn("nftables apply: the batch committed, its answer failed; the namespace holds the ruleset (read back)", "netns", netnsPath, "err", sendErr)
		return nil
	}
	return fmt.Errorf("nftables apply in netns %q (%d tables, %d rules; nothing was changed, read back): %w", netnsPath, ntables, nrules, sendErr)
}

// send sends the whole replacement of meshcni's tables present (among listed, the
// namespace's tables) in one batch. Present tables are deleted (after an add, so
// the delete cannot fail if one vanished meanwhile); absent ones are not touched:
// deleting a table makes the kernel destroy it after an RCU grace period, which the
// closing netlink socket waits for (several milliseconds). Tables are then created
// exclusively, so a table appearing after the listing fails the batch instead of
// merging into it.
func (b *Backend) send(c *gnft.Conn, listed []netlink.Table, tables []desiredTable) (int, error) {
	for _, t := range Ours(listed) {
		c.AddTable(inetTable(t.Name))
		c.DelTable(inetTable(t.Name))
	}
	var setID uint32
	nrules := 0
	for _, dt := range tables {
		t := c.CreateTable(inetTable(dt.name))
		chains := map[string]*gnft.Chain{}
		for _, dc := range dt.chains {
			ch := &gnft.Chain{Name: dc.name, Table: t}
			if dc.base != nil {
				ch.Type = chainTypes[dc.base.Type]
				ch.Hooknum = chainHooks[dc.base.Hook]
				ch.Priority = gnft.ChainPriorityRef(gnft.ChainPriority(dc.base.Priority))
			}
			chains[dc.name] = c.AddChain(ch)
		}
		for _, dc := range dt.chains {
			for _, cr := range dc.rules {
				for _, s := range cr.sets {
					setID++
					set := &gnft.Set{Table: t, ID: setID, Name: "__set%d", Anonymous: true, Constant: true, KeyType: s.keyType}
					elems := make([]gnft.SetElement, len(s.elems))
					for i, e := range s.elems {
						elems[i] = gnft.SetElement{Key: e}
					}
					if err := c.AddSet(set, elems); err != nil {
						return nrules, fmt.Errorf("table %s chain %s rule (%s): anonymous set: %w", dt.name, dc.name, cr.text, err)
					}
					s.lookup.SetID, s.lookup.SetName = set.ID, set.Name
				}
				c.AddRule(&gnft.Rule{Table: t, Chain: chains[dc.name], Exprs: cr.exprs})
				nrules++
			}
		}
	}
	return nrules, c.Flush()
}

// listTables lists the namespace's nftables tables over a pkg/netlink socket
// opened there and closed before the batch (onSocket, if set, gets it first).
func listTables(netnsPath string, onSocket func(fd int)) ([]netlink.Table, error) {
	c, err := netlink.OpenIn(netnsPath, unix.NETLINK_NETFILTER)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	if onSocket != nil {
		onSocket(c.Fd())
	}
	return netlink.ListTables(c)
}

// SocketBuffer is the send and receive buffer of the backend's netlink sockets. The
// largest ruleset the spec's limits allow (spec.MaxListItems prefixes and ports in
// each list) is a batch of several hundred KiB, and the kernel acknowledges each of
// its messages: with the default buffers (about 208 KiB) the send fails with
// EMSGSIZE and the acknowledgements overflow the receive buffer (ENOBUFS) after the
// batch committed. As `nft` does, the buffers are sized for the batch; the kernel
// allocates them only as they fill.
const SocketBuffer = 8 << 20

// sizeBuffers sets SocketBuffer on the socket, past the system maximum where
// allowed (CAP_NET_ADMIN, which the plugin has), else up to it.
func sizeBuffers(fd int) {
	for _, opt := range []struct{ force, plain, size int }{
		{unix.SO_SNDBUFFORCE, unix.SO_SNDBUF, SocketBuffer},
		{unix.SO_RCVBUFFORCE, unix.SO_RCVBUF, receiveBuffer},
	} {
		if unix.SetsockoptInt(fd, unix.SOL_SOCKET, opt.force, opt.size) != nil {
			_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, opt.plain, opt.size)
		}
	}
}

// receiveBuffer is SocketBuffer; a test shrinks it to make the acknowledgements of
// a committed batch overflow.
var receiveBuffer = SocketBuffer
