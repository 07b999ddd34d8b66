// Package sockmap accelerates the hop between an app and its sidecar proxy
// inside a meshed pod: a sockops program records the established TCP sockets of
// the network namespaces that opted in in a SOCKHASH, and an sk_msg program
// hands each message straight to the peer socket's receive queue
// (bpf_msg_redirect_hash), skipping the loopback TCP/IP stack both ways. The
// redirect rules stay as they are: the proxy still accepts the connection and
// reads SO_ORIGINAL_DST; only the bytes of established connections take the
// short path. docs/ebpf.md has the design and the safety argument.
//
// Use: Load once per node (it re-opens what an earlier Load pinned, so an agent
// restart keeps acceleration), Enable/Disable a pod's netns by its cookie,
// Stats for metrics, Close when the agent exits (pins stay), Unload to remove
// programs, maps and pins. Detect says whether the node can run it, and why not.
package sockmap

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// Defaults of Options.
const (
	DefaultBPFFS   = "/sys/fs/bpf"
	DefaultPinDir  = DefaultBPFFS + "/meshcni/sockmap"
	DefaultCgroup2 = "/run/meshcni/cgroup2" // mounted here when the host has no cgroup2 mount
)

// Options say where the programs live. The zero value means the defaults.
type Options struct {
	// PinDir is the bpffs directory holding the pinned programs, maps and link.
	PinDir string
	// Cgroup2 is the cgroup2 directory the sockops program attaches to; empty:
	// the root of the host's cgroup2 mount, or one mounted at DefaultCgroup2.
	Cgroup2 string
	// ForceUnavailable makes Detect (and so Load) fail with this reason, as on a
	// node without the kernel features: the fallback path, testable anywhere.
	ForceUnavailable string
	// MountBPFFS lets Detect mount a bpffs at DefaultBPFFS when the pin directory
	// lies under it and nothing is mounted there, as systemd does at boot. Only for
	// a process in the host's mount namespace: mounted inside a container, the
	// bpffs would be the container's own, and the node would not see the pins.
	// False: a pin directory that is not on a bpffs makes the acceleration
	// unavailable, with that reason.
	MountBPFFS bool
}

func (o Options) pinDir() string {
	if o.PinDir == "" {
		return DefaultPinDir
	}
	return o.PinDir
}

// Accel is the loaded acceleration: the maps the agent updates and reads.
type Accel struct {
	allow, targets, stats *ebpf.Map
	opts                  Options
	closers               []interface{ Close() error }
}

// errStale: the pinned programs are not the ones this build loads (an upgrade).
var errStale = errors.New("pinned programs differ from this build's")

// Load makes the programs run on this node: it re-opens the pinned ones when an
// earlier Load of the same programs left them (an agent restart), else detects,
// removes what is pinned (a partial or older set), loads, pins and attaches —
// sk_msg to the sockhash first, then sockops to the cgroup2 root. On failure
// nothing it created stays behind.
func Load(opts Options) (*Accel, error) {
	if err := forced(opts); err != nil {
		return nil, err
	}
	a, err := open(opts)
	if err == nil {
		return a, nil
	}
	if !errors.Is(err, os.ErrNotExist) && !errors.Is(err, errStale) {
		return nil, fmt.Errorf("re-open pinned eBPF acceleration in %s (Unload removes it): %w", opts.pinDir(), err)
	}
	if _, err := Detect(opts); err != nil {
		return nil, err
	}
	if err := Unload(opts); err != nil {
		return nil, err
	}
	a, err = create(opts)
	if err != nil {
		_ = Unload(opts)
		return nil, err
	}
	return a, nil
}

// create loads, pins and attaches everything.
func create(opts Options) (*Accel, error) {
	if err := ensureBPFFS(opts.pinDir(), opts.MountBPFFS); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	cg, err := cgroup2Dir(opts)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(opts.pinDir(), 0o700); err != nil {
		return nil, fmt.Errorf("create pin directory: %w", err)
	}
	cs, err := loadSpec()
	if err != nil {
		return nil, err
	}
	coll, err := ebpf.NewCollection(cs)
	if err != nil {
		return nil, fmt.Errorf("load eBPF programs: %w", err)
	}
	defer coll.Close()
	for name, m := range coll.Maps {
		if err := m.Pin(filepath.Join(opts.pinDir(), name)); err != nil {
			return nil, fmt.Errorf("pin map %s: %w", name, err)
		}
	}
	for name, p := range coll.Programs {
		if err := p.Pin(filepath.Join(opts.pinDir(), name)); err != nil {
			return nil, fmt.Errorf("pin program %s: %w", name, err)
		}
	}
	if err := link.RawAttachProgram(link.RawAttachProgramOptions{
		Target: coll.Maps[mapSocks].FD(), Program: coll.Programs[progMsg], Attach: ebpf.AttachSkMsgVerdict,
	}); err != nil {
		return nil, fmt.Errorf("attach sk_msg to the sockhash: %w", err)
	}
	l, err := link.AttachCgroup(link.CgroupOptions{Path: cg, Attach: ebpf.AttachCGroupSockOps, Program: coll.Programs[progOps]})
	if err != nil {
		return nil, fmt.Errorf("attach sockops to cgroup2 %s: %w", cg, err)
	}
	defer l.Close()
	if err := l.Pin(filepath.Join(opts.pinDir(), linkOps)); err != nil {
		return nil, fmt.Errorf("pin the sockops link (a bpf_link keeps the attachment past this process): %w", err)
	}
	return open(opts)
}

// open re-opens pinned maps; os.ErrNotExist when nothing (or only part) is
// pinned, errStale when the pinned programs are not this build's.
func open(opts Options) (*Accel, error) {
	dir := opts.pinDir()
	for _, n := range []string{mapAllow, mapSocks, mapTarget, mapPeer, mapStats, progOps, progMsg, linkOps} {
		if _, err := os.Stat(filepath.Join(dir, n)); err != nil {
			return nil, fmt.Errorf("%s: %w", n, os.ErrNotExist)
		}
	}
	if err := samePrograms(dir); err != nil {
		return nil, err
	}
	a := &Accel{opts: opts}
	for _, m := range []struct {
		name string
		dst  **ebpf.Map
	}{{mapAllow, &a.allow}, {mapTarget, &a.targets}, {mapStats, &a.stats}} {
		mp, err := ebpf.LoadPinnedMap(filepath.Join(dir, m.name), nil)
		if err != nil {
			a.Close()
			return nil, fmt.Errorf("open pinned map %s: %w", m.name, err)
		}
		*m.dst = mp
		a.closers = append(a.closers, mp)
	}
	return a, nil
}

// samePrograms compares the pinned programs' tags (the kernel's hash of their
// instructions) with those of this build's programs, loaded for the purpose.
func samePrograms(dir string) error {
	cs, err := loadSpec()
	if err != nil {
		return err
	}
	coll, err := ebpf.NewCollection(cs)
	if err != nil {
		return fmt.Errorf("load eBPF programs: %w", err)
	}
	defer coll.Close()
	for _, n := range []string{progOps, progMsg} {
		want, err := coll.Programs[n].Info()
		if err != nil {
			return fmt.Errorf("program %s: %w", n, err)
		}
		p, err := ebpf.LoadPinnedProgram(filepath.Join(dir, n), nil)
		if err != nil {
			return fmt.Errorf("open pinned program %s: %w", n, err)
		}
		got, err := p.Info()
		p.Close()
		if err != nil {
			return fmt.Errorf("pinned program %s: %w", n, err)
		}
		if got.Tag != want.Tag {
			return fmt.Errorf("%s: tag %s, this build's %s: %w", n, got.Tag, want.Tag, errStale)
		}
	}
	return nil
}

// Close releases this process's handles; the programs keep running from their
// pins (Unload removes them).
func (a *Accel) Close() error {
	var errs []error
	for _, c := range a.closers {
		errs = append(errs, c.Close())
	}
	a.closers = nil
	return errors.Join(errs...)
}

// Pod is how a pod's namespace is accelerated.
type Pod struct {
	// ProxyUID is the pod's proxy UID (Istio: 1337): the proxy's connections to
	// the network are left alone.
	ProxyUID uint32
	// ToApp also accelerates what the proxy sends to the app. Without it (the
	// zero value) only what the app sends to the proxy is, and the proxy's bytes
	// reach the app through TCP: an app that reads its sockets with splice(2),
	// which sees only TCP's queue, would otherwise miss them (docs/ebpf.md). The
	// proxy must not splice either way (Envoy reads with readv).
	ToApp bool
}

// allowValue is the allow map's value.
type allowValue struct {
	ProxyUID uint32
	Flags    uint32
}

// Enable accelerates the TCP connections that become established from now on in
// the network namespace with this cookie (NetnsCookie).
func (a *Accel) Enable(netnsCookie uint64, pod Pod) error {
	v := allowValue{ProxyUID: pod.ProxyUID}
	if !pod.ToApp {
		v.Flags |= flagToProxyOnly
	}
	if err := a.allow.Update(netnsCookie, v, ebpf.UpdateAny); err != nil {
		return fmt.Errorf("enable eBPF acceleration for netns cookie %d: %w", netnsCookie, err)
	}
	return nil
}

// Disable stops recording new sockets of the namespace. Connections already
// accelerated stay so until they close: taking a socket out of the sockhash
// while its peer still redirects to it would drop what it has not read yet.
func (a *Accel) Disable(netnsCookie uint64) error {
	err := a.allow.Delete(netnsCookie)
	if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("disable eBPF acceleration for netns cookie %d: %w", netnsCookie, err)
	}
	return nil
}

// Enabled reports whether the namespace with this cookie is on the allow-list.
func (a *Accel) Enabled(netnsCookie uint64) (bool, error) {
	var v allowValue
	err := a.allow.Lookup(netnsCookie, &v)
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("look up netns cookie %d: %w", netnsCookie, err)
	}
	return true, nil
}

// Stats are the node-wide counters since Load (they survive an agent restart).
type Stats struct {
	Sockets    uint64 // sockets in the sockhash now (open accelerated sockets)
	Recorded   uint64 // sockets recorded since load
	Collisions uint64 // sockets not recorded because their key was taken
	Messages   uint64 // messages redirected to the peer socket
	Bytes      uint64 // bytes redirected
	Misses     uint64 // messages whose peer was not in the map (sent through TCP)
}

// Stats sums the per-CPU counters and counts the sockhash's entries.
func (a *Accel) Stats() (Stats, error) {
	var per [][statsSize]byte
	if err := a.stats.Lookup(uint32(0), &per); err != nil {
		return Stats{}, fmt.Errorf("read eBPF stats: %w", err)
	}
	var c [numCounters]uint64
	for _, cpu := range per {
		for i := range c {
			c[i] += binary.NativeEndian.Uint64(cpu[8*i:])
		}
	}
	s := Stats{Recorded: c[ctrSockets], Collisions: c[ctrCollisions], Messages: c[ctrMsgs], Bytes: c[ctrBytes], Misses: c[ctrMisses]}
	var k [keySize]byte
	it := a.targets.Iterate()
	var v uint64
	for it.Next(&k, &v) {
		s.Sockets++
	}
	if err := it.Err(); err != nil {
		return s, fmt.Errorf("count accelerated sockets: %w", err)
	}
	return s, nil
}

// Unload detaches the programs and removes maps and pins; already absent is
// fine. Accelerated connections open at that moment lose what their receiver had
// not read yet (the kernel drops a socket's redirected queue with the map).
func Unload(opts Options) error {
	dir := opts.pinDir()
	var errs []error
	if l, err := link.LoadPinnedLink(filepath.Join(dir, linkOps), nil); err == nil {
		errs = append(errs, l.Unpin(), l.Close())
	} else if !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, fmt.Errorf("open the sockops link: %w", err))
	}
	if m, err := ebpf.LoadPinnedMap(filepath.Join(dir, mapSocks), nil); err == nil {
		if p, err := ebpf.LoadPinnedProgram(filepath.Join(dir, progMsg), nil); err == nil {
			err := link.RawDetachProgram(link.RawDetachProgramOptions{Target: m.FD(), Program: p, Attach: ebpf.AttachSkMsgVerdict})
			if err != nil && !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, fmt.Errorf("detach sk_msg: %w", err))
			}
			p.Close()
		}
		m.Close()
	}
	for _, n := range []string{mapAllow, mapSocks, mapTarget, mapPeer, mapStats, progOps, progMsg, linkOps} {
		if err := os.Remove(filepath.Join(dir, n)); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("remove pin %s: %w", n, err))
		}
	}
	if err := os.Remove(dir); err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, fmt.Errorf("remove pin directory: %w", err))
	}
	// Load made the parent too (the default's /sys/fs/bpf/meshcni): gone when empty.
	if parent := filepath.Dir(dir); parent != DefaultBPFFS && parent != filepath.Dir(parent) {
		_ = os.Remove(parent)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("unload eBPF acceleration: %w", err)
	}
	return nil
}
