// Package traffic holds real-packet test helpers: a "pod" network namespace wired to a
// "peer" namespace, the meshcni-proxysim stand-in sidecar started inside a namespace as
// the proxy UID, an in-process app server, and TCP/DNS clients that run as a chosen UID.
//
// Everything that must be attributed to a UID (the proxy, the clients) runs as a child
// process: owner matches (iptables --uid-owner, nft meta skuid) look at the UID of the
// socket's creator, so an in-process socket would always be root's.
//
// How a child lands in a namespace: a goroutine locks its OS thread, switches that
// thread into the namespace (ns.NetNS.Set), starts the child (which inherits the
// thread's namespace) and then waits for it; it never unlocks, so the thread dies with
// the goroutine instead of returning to the scheduler in the wrong namespace. The
// child's SysProcAttr sets Credential{Uid,Gid} (supplementary groups dropped),
// Pdeathsig (tied to that waiting thread, so the child dies with the test binary) and,
// only when asked (TPROXY), the CAP_NET_ADMIN ambient capability.
//
// The proxysim binary (and any other command a test runs as UID 1337, through
// Binary) is built once per test binary with `go build` (CGO_ENABLED=0) into
// /tmp/meshcni-proxysim.<pid>/ (0755, so UID 1337 can execute it); directories
// left by dead test binaries are removed on the next build. Set MESHCNI_PROXYSIM to a
// prebuilt binary to skip the build. Without `go` on PATH the test skips (fails under
// CI=true).
package traffic
