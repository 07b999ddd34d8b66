package sockmap

import (
	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/btf"
)

// Names of the maps and programs, also their pin names under the pin directory.
const (
	mapAllow  = "allow"   // HASH netns cookie → {proxy UID, flags}: the namespaces that opted in
	mapSocks  = "socks"   // SOCKHASH pairKey → socket: the senders, sk_msg attached
	mapTarget = "targets" // SOCKHASH pairKey → socket: every recorded socket (redirect targets)
	mapPeer   = "peer"    // SK_STORAGE per socket: the key of its peer, and whether it fell back
	mapStats  = "stats"   // PERCPU_ARRAY[1] of counters
	progOps   = "sockops"
	progMsg   = "skmsg"
	linkOps   = "sockops_link"
	maxAllow  = 1 << 16
	maxSocks  = 1 << 18
	keySize   = 16 // pairKey
	peerSize  = 24 // peerValue
	statsSize = 8 * numCounters
)

// Counter indexes in the stats map's one per-CPU value (u64 each).
const (
	ctrSockets    = iota // sockets recorded in the sockhash
	ctrCollisions        // sockets not recorded: their key was taken or ambiguous
	ctrMsgs              // messages redirected to the peer socket
	ctrBytes             // bytes redirected
	ctrMisses            // messages whose peer was not in the map: sent through TCP
	numCounters
)

// Offsets in the kernel's UAPI context structs (include/uapi/linux/bpf.h); the
// tests check them against the running kernel's BTF.
const (
	opsOp      = 0   // bpf_sock_ops.op
	opsFamily  = 20  // bpf_sock_ops.family
	opsRemote4 = 24  // bpf_sock_ops.remote_ip4
	opsLocal4  = 28  // bpf_sock_ops.local_ip4
	opsRemote6 = 32  // bpf_sock_ops.remote_ip6
	opsLocal6  = 48  // bpf_sock_ops.local_ip6
	opsRcvNxt  = 100 // bpf_sock_ops.rcv_nxt
	opsSndNxt  = 104 // bpf_sock_ops.snd_nxt
	opsSk      = 184 // bpf_sock_ops.sk
	msgSize    = 68  // sk_msg_md.size
	msgSk      = 72  // sk_msg_md.sk
	opsActive  = 4   // BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB
	opsPassive = 5   // BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB
	skPass     = 1   // SK_PASS
	fIngress   = 1   // BPF_F_INGRESS
	fNoExist   = 1   // BPF_NOEXIST
	fCreate    = 1   // BPF_SK_STORAGE_GET_F_CREATE
	afInet     = 2   // AF_INET
)

// The pairing key (16 bytes): {netns cookie u64, seq u32, ack u32}. A TCP socket
// at the moment it becomes established records itself under
// {its netns, snd_nxt, rcv_nxt} and its peer under {its netns, rcv_nxt, snd_nxt}:
// the two ends of one connection see the same two initial sequence numbers
// swapped, whatever NAT did to their addresses (REDIRECT changes addresses and
// ports, never sequence numbers), so an app's socket and the proxy's socket it
// was redirected to pair up, and so do the proxy's socket to the app over
// 127.0.0.6 and the app's accepted one. Sockets of other namespaces never match
// (the cookie), and within one namespace a false match needs two 32-bit initial
// sequence numbers to coincide.
//
// The peer value (24 bytes, socket storage): {peer key 16 B, fell back u32, pad}.

// Stack layout of the sockops program (r10-relative).
const (
	stCookie = -8  // u64 netns cookie (allow map key)
	stKey    = -24 // pairKey
	stZero   = -28 // u32 0 (stats index)
	stFlags  = -32 // u32: the pod's flags, then the socket's initial pass flag
)

// flagToProxyOnly in a pod's allow entry: only the app's sockets redirect (into
// the proxy's); the proxy's messages to the app go through TCP.
const flagToProxyOnly = 1

// spec returns the maps and programs; uidOff is the offset of sk_uid in the
// kernel's struct sock (kernelLayout). Loading it is the only way the kernel
// judges them (the verifier), so Detect loads it too.
func spec(uidOff int16) *ebpf.CollectionSpec {
	u32 := &btf.Int{Name: "u32", Size: 4}
	return &ebpf.CollectionSpec{
		Maps: map[string]*ebpf.MapSpec{
			mapAllow:  {Name: mapAllow, Type: ebpf.Hash, KeySize: 8, ValueSize: 8, MaxEntries: maxAllow},
			mapSocks:  {Name: mapSocks, Type: ebpf.SockHash, KeySize: keySize, ValueSize: 8, MaxEntries: maxSocks},
			mapTarget: {Name: mapTarget, Type: ebpf.SockHash, KeySize: keySize, ValueSize: 8, MaxEntries: maxSocks},
			mapPeer: {Name: mapPeer, Type: ebpf.SkStorage, KeySize: 4, ValueSize: peerSize,
				Flags: 1, // BPF_F_NO_PREALLOC, required
				Key:   u32,
				Value: &btf.Array{Index: u32, Type: &btf.Int{Name: "u8", Size: 1}, Nelems: peerSize}},
			mapStats: {Name: mapStats, Type: ebpf.PerCPUArray, KeySize: 4, ValueSize: statsSize, MaxEntries: 1},
		},
		Programs: map[string]*ebpf.ProgramSpec{
			progOps: {Name: progOps, Type: ebpf.SockOps, License: "Dual MIT/GPL", Instructions: sockopsInsns(uidOff)},
			progMsg: {Name: progMsg, Type: ebpf.SkMsg, License: "Dual MIT/GPL", Instructions: skmsgInsns()},
		},
	}
}

// count adds the value in reg (or imm when reg is 0xff) to counter ctr; it
// clobbers r0-r5 and uses the u32 at stZero.
func count(ctr int, reg asm.Register, imm int32, label string) asm.Instructions {
	add := asm.Add.Imm(asm.R1, imm)
	if reg != asm.RFP {
		add = asm.Add.Reg(asm.R1, reg)
	}
	return asm.Instructions{
		asm.StoreImm(asm.RFP, stZero, 0, asm.Word),
		asm.LoadMapPtr(asm.R1, 0).WithReference(mapStats),
		asm.Mov.Reg(asm.R2, asm.RFP),
		asm.Add.Imm(asm.R2, stZero),
		asm.FnMapLookupElem.Call(),
		asm.JEq.Imm(asm.R0, 0, label),
		asm.LoadMem(asm.R1, asm.R0, int16(8*ctr), asm.DWord),
		add,
		asm.StoreMem(asm.R0, int16(8*ctr), asm.R1, asm.DWord),
		asm.Mov.Imm(asm.R0, 0).WithSymbol(label), // join point
	}
}

// localOnly jumps to yes when the address at the context offsets (IPv4 off4,
// IPv6 off6) exists only inside the pod: 127.0.0.0/8, ::1, ::6 (Istio's IPv6
// inbound passthrough source) or ::ffff:127.0.0.0/104. The words are in network
// byte order, read as little-endian u32 (amd64, arm64).
func localOnly(off4, off6 int16, yes, id string) asm.Instructions {
	v6, w3, end := id+"_v6", id+"_w3", id+"_end"
	return asm.Instructions{
		asm.LoadMem(asm.R1, asm.R6, opsFamily, asm.Word),
		asm.JNE.Imm(asm.R1, afInet, v6),
		asm.LoadMem(asm.R2, asm.R6, off4, asm.Word),
		asm.And.Imm(asm.R2, 0xff),
		asm.JEq.Imm(asm.R2, 127, yes),
		asm.Ja.Label(end),
		asm.LoadMem(asm.R2, asm.R6, off6, asm.Word).WithSymbol(v6),
		asm.JNE.Imm(asm.R2, 0, end),
		asm.LoadMem(asm.R2, asm.R6, off6+4, asm.Word),
		asm.JNE.Imm(asm.R2, 0, end),
		asm.LoadMem(asm.R2, asm.R6, off6+8, asm.Word),
		asm.JEq.Imm(asm.R2, 0, w3),
		asm.LoadImm(asm.R3, 0xffff0000, asm.DWord),
		asm.JNE.Reg(asm.R2, asm.R3, end),
		asm.LoadMem(asm.R2, asm.R6, off6+12, asm.Word),
		asm.And.Imm(asm.R2, 0xff),
		asm.JEq.Imm(asm.R2, 127, yes),
		asm.Ja.Label(end),
		asm.LoadMem(asm.R2, asm.R6, off6+12, asm.Word).WithSymbol(w3),
		asm.JEq.Imm(asm.R2, 0x01000000, yes),
		asm.JEq.Imm(asm.R2, 0x06000000, yes),
		asm.Mov.Imm(asm.R0, 0).WithSymbol(end),
	}
}

// sockopsInsns: on ACTIVE/PASSIVE_ESTABLISHED in an allowed netns, for a socket
// that can be one end of an in-pod hop — one of its addresses exists only
// inside the pod, or it is an active socket not owned by the pod's proxy UID
// (an app's connection, which the redirect sends to the proxy) — write the
// peer key into the socket's storage and record the socket under its own key
// (BPF_NOEXIST: a taken key is never overwritten). The proxy's own connections
// to the network and connections from the network are left alone.
func sockopsInsns(uidOff int16) asm.Instructions {
	var ins asm.Instructions
	for _, part := range []asm.Instructions{
		opsAllowed(),
		opsOwner(uidOff),
		localOnly(opsLocal4, opsLocal6, "hop", "l"),
		localOnly(opsRemote4, opsRemote6, "hop", "r"),
		opsHopEnd(),
		opsStorePeer(),
		opsRecord(),
		count(ctrSockets, asm.RFP, 1, "counted"),
		{asm.Ja.Label("out"), asm.Mov.Imm(asm.R0, 0).WithSymbol("collide")},
		count(ctrCollisions, asm.RFP, 1, "counted2"),
		{asm.Mov.Imm(asm.R0, 1).WithSymbol("out"), asm.Return()},
	} {
		ins = append(ins, part...)
	}
	return ins
}

// opsAllowed: an ESTABLISHED callback in an allowed netns goes on with r6 =
// ctx, r7 = netns cookie, r9 = the pod's proxy UID, stFlags = the pod's flags.
func opsAllowed() asm.Instructions {
	return asm.Instructions{
		asm.Mov.Reg(asm.R6, asm.R1).WithSymbol(progOps),
		asm.LoadMem(asm.R2, asm.R6, opsOp, asm.Word),
		asm.JEq.Imm(asm.R2, opsActive, "est"),
		asm.JEq.Imm(asm.R2, opsPassive, "est"),
		asm.Ja.Label("out"),
		asm.Mov.Reg(asm.R1, asm.R6).WithSymbol("est"),
		asm.FnGetNetnsCookie.Call(),
		asm.Mov.Reg(asm.R7, asm.R0),
		asm.StoreMem(asm.RFP, stCookie, asm.R7, asm.DWord),
		asm.LoadMapPtr(asm.R1, 0).WithReference(mapAllow),
		asm.Mov.Reg(asm.R2, asm.RFP),
		asm.Add.Imm(asm.R2, stCookie),
		asm.FnMapLookupElem.Call(),
		asm.JEq.Imm(asm.R0, 0, "out"),
		asm.LoadMem(asm.R9, asm.R0, 0, asm.Word),
		asm.LoadMem(asm.R1, asm.R0, 4, asm.Word),
		asm.StoreMem(asm.RFP, stFlags, asm.R1, asm.Word),
	}
}

// opsOwner: r8 = the socket's owner, sk->sk_uid.
func opsOwner(uidOff int16) asm.Instructions {
	return asm.Instructions{
		asm.LoadMem(asm.R1, asm.R6, opsSk, asm.DWord),
		asm.JEq.Imm(asm.R1, 0, "out"),
		asm.FnSkcToTcpSock.Call(),
		asm.JEq.Imm(asm.R0, 0, "out"),
		asm.LoadMem(asm.R8, asm.R0, uidOff, asm.Word),
	}
}

// opsHopEnd: without a pod-local address (localOnly fell through), only an
// active socket not owned by the proxy is a hop's end. At "hop": a proxy
// socket of a to-proxy-only pod starts as passing (stFlags = 1): it is a
// redirect target, its own messages go through TCP; any other starts at 0.
func opsHopEnd() asm.Instructions {
	return asm.Instructions{
		asm.LoadMem(asm.R2, asm.R6, opsOp, asm.Word),
		asm.JNE.Imm(asm.R2, opsActive, "out"),
		asm.JEq.Reg(asm.R8, asm.R9, "out"),
		asm.Mov.Imm(asm.R1, 0).WithSymbol("hop"),
		asm.JNE.Reg(asm.R8, asm.R9, "app"),
		asm.LoadMem(asm.R1, asm.RFP, stFlags, asm.Word),
		asm.And.Imm(asm.R1, flagToProxyOnly),
		asm.StoreMem(asm.RFP, stFlags, asm.R1, asm.Word).WithSymbol("app"),
	}
}

// opsStorePeer: r8 = snd_nxt, r9 = rcv_nxt (equal ones would pair the socket
// with itself: collide); the socket's storage gets its peer's key and its
// initial pass flag.
func opsStorePeer() asm.Instructions {
	return asm.Instructions{
		asm.LoadMem(asm.R8, asm.R6, opsSndNxt, asm.Word),
		asm.LoadMem(asm.R9, asm.R6, opsRcvNxt, asm.Word),
		asm.JEq.Reg(asm.R8, asm.R9, "collide"),
		asm.LoadMem(asm.R2, asm.R6, opsSk, asm.DWord),
		asm.JEq.Imm(asm.R2, 0, "out"),
		asm.LoadMapPtr(asm.R1, 0).WithReference(mapPeer),
		asm.Mov.Imm(asm.R3, 0),
		asm.Mov.Imm(asm.R4, fCreate),
		asm.FnSkStorageGet.Call(),
		asm.JEq.Imm(asm.R0, 0, "out"),
		asm.StoreMem(asm.R0, 0, asm.R7, asm.DWord),
		asm.StoreMem(asm.R0, 8, asm.R9, asm.Word),
		asm.StoreMem(asm.R0, 12, asm.R8, asm.Word),
		asm.LoadMem(asm.R1, asm.RFP, stFlags, asm.Word),
		asm.StoreMem(asm.R0, 16, asm.R1, asm.Word),
	}
}

// opsRecord records the socket under its own key: as a redirect target, and
// as a sender unless it starts as passing (then its sendmsg stays the kernel's
// own: a socket only in a sockhash without sk_msg keeps TCP's).
func opsRecord() asm.Instructions {
	update := func(m string) asm.Instructions {
		return asm.Instructions{
			asm.Mov.Reg(asm.R1, asm.R6),
			asm.LoadMapPtr(asm.R2, 0).WithReference(m),
			asm.Mov.Reg(asm.R3, asm.RFP),
			asm.Add.Imm(asm.R3, stKey),
			asm.Mov.Imm(asm.R4, fNoExist),
			asm.FnSockHashUpdate.Call(),
			asm.JNE.Imm(asm.R0, 0, "collide"),
		}
	}
	ins := asm.Instructions{
		asm.StoreMem(asm.RFP, stKey, asm.R7, asm.DWord),
		asm.StoreMem(asm.RFP, stKey+8, asm.R8, asm.Word),
		asm.StoreMem(asm.RFP, stKey+12, asm.R9, asm.Word),
	}
	ins = append(ins, update(mapTarget)...)
	ins = append(ins, asm.LoadMem(asm.R1, asm.RFP, stFlags, asm.Word), asm.JNE.Imm(asm.R1, 0, "recorded"))
	ins = append(ins, update(mapSocks)...)
	return append(ins, asm.Mov.Imm(asm.R0, 0).WithSymbol("recorded"))
}

// skmsgInsns: a message sent on a recorded socket goes straight into its peer's
// receive queue (bpf_msg_redirect_hash, BPF_F_INGRESS). When the peer is not in
// the map the message passes through TCP, and so does everything the socket
// sends after it: the receiver reads its redirected queue before its TCP one, so
// switching back to redirecting would reorder the stream.
func skmsgInsns() asm.Instructions {
	ins := asm.Instructions{
		asm.Mov.Reg(asm.R6, asm.R1).WithSymbol(progMsg),
		asm.LoadMem(asm.R2, asm.R6, msgSk, asm.DWord),
		asm.JEq.Imm(asm.R2, 0, "pass"),
		asm.LoadMapPtr(asm.R1, 0).WithReference(mapPeer),
		asm.Mov.Imm(asm.R3, 0),
		asm.Mov.Imm(asm.R4, 0),
		asm.FnSkStorageGet.Call(),
		asm.JEq.Imm(asm.R0, 0, "pass"),
		asm.Mov.Reg(asm.R7, asm.R0),
		asm.LoadMem(asm.R1, asm.R7, 16, asm.Word),
		asm.JNE.Imm(asm.R1, 0, "pass"),
		asm.LoadMem(asm.R8, asm.R6, msgSize, asm.Word),
		asm.Mov.Reg(asm.R1, asm.R6),
		asm.LoadMapPtr(asm.R2, 0).WithReference(mapTarget),
		asm.Mov.Reg(asm.R3, asm.R7),
		asm.Mov.Imm(asm.R4, fIngress),
		asm.FnMsgRedirectHash.Call(),
		asm.JNE.Imm(asm.R0, skPass, "miss"),
	}
	ins = append(ins, count(ctrMsgs, asm.RFP, 1, "c1")...)
	ins = append(ins, count(ctrBytes, asm.R8, 0, "c2")...)
	ins = append(ins, asm.Ja.Label("pass"))
	ins = append(ins, asm.StoreImm(asm.R7, 16, 1, asm.Word).WithSymbol("miss"))
	ins = append(ins, count(ctrMisses, asm.RFP, 1, "c3")...)
	return append(ins,
		asm.Mov.Imm(asm.R0, skPass).WithSymbol("pass"),
		asm.Return(),
	)
}
