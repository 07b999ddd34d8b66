package sockmap_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"

	"github.com/meshcni/meshcni/internal/standin/proxysim"
	"github.com/meshcni/meshcni/internal/testkit/testutil"
	"github.com/meshcni/meshcni/internal/testkit/traffic"
	"github.com/meshcni/meshcni/pkg/ebpf/sockmap"
)

// ending is how a read side saw its connection end.
func ending(err error) string {
	switch {
	case err == nil, errors.Is(err, io.EOF):
		return "EOF"
	case errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE):
		return "reset"
	default:
		return err.Error()
	}
}

// resetScenario: the app sends 256 KiB through the proxy to a peer that reads
// them, answers 64 KiB and resets the connection (SO_LINGER 0). It returns what
// the app read and how its connection ended.
func resetScenario(t *testing.T, p *pod) (got []byte, want []byte, end string) {
	t.Helper()
	want = make([]byte, 64<<10)
	_, _ = rand.Read(want)
	ln := listenIn(t, p.PeerNetNS, "[::]:8081")
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		_, _ = io.CopyN(io.Discard, c, 256<<10)
		_, _ = c.Write(want)
		time.Sleep(100 * time.Millisecond)
		_ = c.(*net.TCPConn).SetLinger(0)
		c.Close()
	}()
	c := dial(t, p.NetNS, withPort(peer4, 8081))
	_ = c.SetDeadline(time.Now().Add(20 * time.Second))
	payload := make([]byte, 256<<10)
	if _, err := c.Write(payload); err != nil {
		t.Fatalf("write: %v", err)
	}
	got, err := io.ReadAll(c)
	return got, want, ending(err)
}

// TestBehavesAsPlainTCP runs the same scenarios in a pod that opted in and in
// one that did not, and wants the same outcome: a half-close delivers everything
// then EOF (roundTrip), a reset by the far peer ends the app's connection the
// same way after the same bytes, a proxy killed mid-stream ends it the same way.
func TestBehavesAsPlainTCP(t *testing.T) {
	a, _ := load(t)
	plain, accel := newPod(t), newPod(t)
	if err := a.Enable(cookie(t, accel.NetNS), sockmap.Pod{ProxyUID: traffic.ProxyUID, ToApp: true}); err != nil {
		t.Fatal(err)
	}
	t.Run("half-close", func(t *testing.T) {
		for _, p := range []*pod{plain, accel} {
			roundTrip(t, dial(t, p.NetNS, peer4), 1<<20)
			roundTrip(t, dial(t, p.NetNS, peer6), 1<<20)
		}
	})
	t.Run("peer resets", func(t *testing.T) {
		gotP, wantP, endP := resetScenario(t, plain)
		before := stats(t, a)
		gotA, wantA, endA := resetScenario(t, accel)
		if after := stats(t, a); after.Bytes == before.Bytes {
			t.Errorf("opted-in pod: nothing redirected")
		}
		if !bytes.Equal(gotP, wantP) || !bytes.Equal(gotA, wantA) {
			t.Errorf("bytes before the reset: plain %d exact=%v, accelerated %d exact=%v", len(gotP), bytes.Equal(gotP, wantP), len(gotA), bytes.Equal(gotA, wantA))
		}
		t.Logf("peer reset: plain read %d bytes then %s; accelerated %d then %s", len(gotP), endP, len(gotA), endA)
		if endP != endA {
			t.Errorf("connection ended with %q when plain, %q when accelerated", endP, endA)
		}
	})
	t.Run("proxy killed mid-stream, then restarted", func(t *testing.T) {
		var ends []string
		for _, p := range []*pod{plain, accel} {
			c := dial(t, p.NetNS, peer4)
			_ = c.SetDeadline(time.Now().Add(20 * time.Second))
			buf := make([]byte, 64<<10)
			if _, err := c.Write(buf); err != nil {
				t.Fatal(err)
			}
			if _, err := io.ReadFull(c, buf); err != nil {
				t.Fatalf("echo before the kill: %v", err)
			}
			if err := p.proxy.Cmd.Process.Kill(); err != nil {
				t.Fatal(err)
			}
			_, err := io.ReadAll(c)
			ends = append(ends, ending(err))
			p.proxy = startProxy(t, p.NetNS) // the listeners come back
		}
		t.Logf("proxy killed: plain %s, accelerated %s", ends[0], ends[1])
		if ends[0] != ends[1] {
			t.Errorf("proxy killed: the app's connection ended with %q when plain, %q when accelerated", ends[0], ends[1])
		}
		before := stats(t, a)
		roundTrip(t, dial(t, accel.NetNS, peer4), 1<<20)
		if after := stats(t, a); after.Bytes-before.Bytes < 2<<20 {
			t.Errorf("after the proxy restart: %d bytes redirected, want ≥ 2 MiB", after.Bytes-before.Bytes)
		}
		accel.proxy.WaitRecord(t, 5*time.Second, func(r proxysim.Record) bool { return r.OrigDst == peer4 })
	})
}

// TestAgentRestart: the agent's process goes away (Close) while a connection
// is open and a new one re-opens the pins (Load): the connection keeps its
// bytes exact and accelerated, counters carry on, new connections are
// accelerated, the pod stays enabled.
func TestAgentRestart(t *testing.T) {
	a, opts := load(t)
	p := newPod(t)
	ck := cookie(t, p.NetNS)
	if err := a.Enable(ck, sockmap.Pod{ProxyUID: traffic.ProxyUID, ToApp: true}); err != nil {
		t.Fatal(err)
	}
	c := dial(t, p.NetNS, peer4)
	_ = c.SetDeadline(time.Now().Add(20 * time.Second))
	half := func() {
		want := make([]byte, 1<<20)
		_, _ = rand.Read(want)
		go func() { _, _ = c.Write(want) }()
		got := make([]byte, len(want))
		if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, want) {
			t.Fatalf("echo across the restart: %v, exact=%v", err, bytes.Equal(got, want))
		}
	}
	half()
	s1 := stats(t, a)
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	a2, err := sockmap.Load(opts)
	if err != nil {
		t.Fatalf("load after restart: %v", err)
	}
	defer a2.Close()
	if on, err := a2.Enabled(ck); err != nil || !on {
		t.Fatalf("pod enabled after restart: %v, %v", on, err)
	}
	half()
	s2 := stats(t, a2)
	if s2.Bytes-s1.Bytes < 2<<20 {
		t.Errorf("open connection after restart: %d bytes redirected, want ≥ 2 MiB (stats %+v → %+v)", s2.Bytes-s1.Bytes, s1, s2)
	}
	if s2.Sockets < 2 {
		t.Errorf("accelerated sockets after restart: %d, want the open pair (≥ 2)", s2.Sockets)
	}
	roundTrip(t, dial(t, p.NetNS, peer6), 1<<20)
	if s3 := stats(t, a2); s3.Bytes-s2.Bytes < 2<<20 {
		t.Errorf("new connection after restart: %d bytes redirected", s3.Bytes-s2.Bytes)
	}
}

// TestForcedUnavailable: with detection forced to fail, Detect and Load say why
// and leave nothing behind, and a meshed pod is redirected exactly as without
// acceleration: the proxy gets the connection and its original destination.
func TestForcedUnavailable(t *testing.T) {
	testutil.RequireRoot(t)
	opts := testOptions(t)
	opts.ForceUnavailable = "test says so"
	for name, f := range map[string]func() error{
		"Detect": func() error { _, err := sockmap.Detect(opts); return err },
		"Load":   func() error { _, err := sockmap.Load(opts); return err },
	} {
		err := f()
		if !errors.Is(err, sockmap.ErrUnavailable) || !strings.Contains(err.Error(), "test says so") {
			t.Errorf("%s: want ErrUnavailable naming the reason, got %v", name, err)
		}
	}
	if _, err := os.Stat(opts.PinDir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("pin directory after a refused Load: %v, want none", err)
	}
	p := newPod(t)
	roundTrip(t, dial(t, p.NetNS, peer4), 1<<20)
	p.proxy.WaitRecord(t, 5*time.Second, func(r proxysim.Record) bool {
		return r.Listener == proxysim.ListenerOutbound && r.OrigDst == peer4
	})
}

// TestUnload: Unload detaches and frees the programs and maps and removes the
// pins; a later Load starts afresh.
func TestUnload(t *testing.T) {
	testutil.RequireRoot(t)
	opts := testOptions(t)
	a, err := sockmap.Load(opts)
	if errors.Is(err, sockmap.ErrUnavailable) {
		testutil.Missing(t, "%v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	var ids []ebpf.ProgramID
	for _, n := range []string{"sockops", "skmsg"} {
		prog, err := ebpf.LoadPinnedProgram(opts.PinDir+"/"+n, nil)
		if err != nil {
			t.Fatal(err)
		}
		info, err := prog.Info()
		if err != nil {
			t.Fatal(err)
		}
		id, _ := info.ID()
		ids = append(ids, id)
		prog.Close()
	}
	a.Close()
	if err := sockmap.Unload(opts); err != nil {
		t.Fatal(err)
	}
	defer os.Remove(opts.PinDir[:strings.LastIndex(opts.PinDir, "/")])
	if _, err := os.Stat(opts.PinDir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("pin directory after Unload: %v", err)
	}
	if _, err := os.Stat(filepath.Dir(opts.PinDir)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the pin directory's parent %s (empty, made by Load) after Unload: %v", filepath.Dir(opts.PinDir), err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, id := range ids {
		for { // the kernel frees programs after an RCU grace period
			prog, err := ebpf.NewProgramFromID(id)
			if err != nil {
				break
			}
			prog.Close()
			if ctx.Err() != nil {
				t.Fatalf("program %d still loaded after Unload", id)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	if err := sockmap.Unload(opts); err != nil {
		t.Errorf("second Unload: %v", err)
	}
	a, err = sockmap.Load(opts)
	if err != nil {
		t.Fatalf("Load after Unload: %v", err)
	}
	a.Close()
	if err := sockmap.Unload(opts); err != nil {
		t.Fatal(err)
	}
}

// TestLoadReplacesStalePins: pins whose programs are not this build's (an
// upgrade) are replaced by Load, and the replacement accelerates.
func TestLoadReplacesStalePins(t *testing.T) {
	a, opts := load(t)
	a.Close()
	old, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.SkMsg, License: "MIT", Instructions: asm.Instructions{
		asm.Mov.Imm(asm.R0, 1), asm.Return(),
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer old.Close()
	pin := filepath.Join(opts.PinDir, "skmsg")
	if err := os.Remove(pin); err != nil {
		t.Fatal(err)
	}
	if err := old.Pin(pin); err != nil {
		t.Fatal(err)
	}
	a, err = sockmap.Load(opts)
	if err != nil {
		t.Fatalf("Load over stale pins: %v", err)
	}
	defer a.Close()
	p, err := ebpf.LoadPinnedProgram(pin, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	info, err := p.Info()
	if err != nil {
		t.Fatal(err)
	}
	oldInfo, _ := old.Info()
	if info.Tag == oldInfo.Tag {
		t.Fatalf("the stale program is still pinned")
	}
	pd := newPod(t)
	if err := a.Enable(cookie(t, pd.NetNS), sockmap.Pod{ProxyUID: traffic.ProxyUID}); err != nil {
		t.Fatal(err)
	}
	before := stats(t, a)
	roundTrip(t, dial(t, pd.NetNS, peer4), 1<<20)
	if after := stats(t, a); after.Bytes-before.Bytes < 1<<20 {
		t.Errorf("after replacing stale pins: %d bytes redirected, want ≥ 1 MiB", after.Bytes-before.Bytes)
	}
}
