package testbed

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// component is one running daemon of the test bed.
type component struct {
	name    string
	cmd     *exec.Cmd
	logPath string
	done    chan struct{}
	err     error
}

// managed guards the set of pids started through exec.Cmd, so the reaper never
// steals their exit status.
var (
	managedMu sync.Mutex
	managed   = map[int]bool{}
)

func startComponent(name, bin string, args ...string) (*component, error) {
	if err := os.MkdirAll(LogDir, 0o755); err != nil {
		return nil, err
	}
	logPath := filepath.Join(LogDir, name+".log")
	f, err := os.OpenFile(logPath, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o644)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fmt.Fprintf(f, "# %s %s\n", bin, strings.Join(args, " "))
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.Env = append(os.Environ(), "PATH="+pathWith(filepath.Dir(bin)))
	// Own process group: a ^C to the test does not reach the daemons, which are
	// stopped in order by Stop.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	managedMu.Lock()
	err = cmd.Start()
	if err == nil {
		managed[cmd.Process.Pid] = true
	}
	managedMu.Unlock()
	if err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	c := &component{name: name, cmd: cmd, logPath: logPath, done: make(chan struct{})}
	go func() {
		c.err = cmd.Wait()
		managedMu.Lock()
		delete(managed, cmd.Process.Pid)
		managedMu.Unlock()
		close(c.done)
	}()
	return c, nil
}

func pathWith(dir string) string {
	p := os.Getenv("PATH")
	if p == "" {
		p = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	}
	return p + ":" + dir
}

func (c *component) exited() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}

// stop sends SIGTERM, then SIGKILL after grace.
func (c *component) stop(grace time.Duration) {
	if c.exited() {
		return
	}
	_ = c.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-c.done:
		return
	case <-time.After(grace):
	}
	_ = c.cmd.Process.Kill()
	select {
	case <-c.done:
	case <-time.After(5 * time.Second):
	}
}

// tail returns the last n lines of a file.
func tail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(cannot read %s: %v)", path, err)
	}
	lines := bytes.Split(bytes.TrimRight(b, "\n"), []byte("\n"))
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return string(bytes.Join(lines, []byte("\n")))
}

func (c *component) failure(err error) error {
	return fmt.Errorf("%s: %w\n--- last lines of %s ---\n%s\n---", c.name, err, c.logPath, tail(c.logPath, 40))
}

// reaper: the test bed's process becomes a child subreaper, so containerd's shims
// (which daemonise) are re-parented to it rather than to PID 1, which on some
// machines (firecracker init, containers) never reaps them. It reaps only zombies
// it recognises as the runtime's, never the exit status of other exec.Cmd children.
var (
	reaperOnce sync.Once
	reapComms  = []string{"containerd-shim", "runc"}
)

func startReaper() {
	reaperOnce.Do(func() {
		_ = unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
		go func() {
			for {
				time.Sleep(500 * time.Millisecond)
				reapOrphans()
			}
		}()
	})
}

func reapOrphans() {
	self := os.Getpid()
	for _, p := range listProcs() {
		if p.ppid != self || p.state != 'Z' {
			continue
		}
		managedMu.Lock()
		mine := managed[p.pid]
		managedMu.Unlock()
		if mine || !hasPrefixAny(p.comm, reapComms) {
			continue
		}
		var ws unix.WaitStatus
		_, _ = unix.Wait4(p.pid, &ws, unix.WNOHANG, nil)
	}
}

func hasPrefixAny(s string, prefixes []string) bool {
	for _, p := range prefixes {
		if strings.HasPrefix(s, p) {
			return true
		}
	}
	return false
}

type procInfo struct {
	pid, ppid int
	state     byte
	comm      string
}

func listProcs() []procInfo {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var out []procInfo
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...
		s := string(b)
		l, r := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
		if l < 0 || r < l || r+4 > len(s) {
			continue
		}
		fields := strings.Fields(s[r+2:])
		if len(fields) < 2 {
			continue
		}
		ppid, _ := strconv.Atoi(fields[1])
		out = append(out, procInfo{pid: pid, ppid: ppid, state: fields[0][0], comm: s[l+1 : r]})
	}
	return out
}

func cmdline(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil {
		return ""
	}
	return string(bytes.ReplaceAll(b, []byte{0}, []byte{' '}))
}

func pidAlive(pid int) bool {
	if pid <= 0 {
		return false
	}
	err := unix.Kill(pid, 0)
	if err != nil && !errors.Is(err, unix.EPERM) {
		return false
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	r := bytes.LastIndexByte(b, ')')
	return r < 0 || r+2 >= len(b) || b[r+2] != 'Z'
}

// ourProcesses lists live processes belonging to a test bed: those whose command
// line mentions BaseDir or RunDir (every daemon, containerd's shims) and their
// descendants (pod processes). Zombies are not listed.
func ourProcesses() []procInfo {
	procs := listProcs()
	children := map[int][]procInfo{}
	var roots []procInfo
	self := os.Getpid()
	for _, p := range procs {
		children[p.ppid] = append(children[p.ppid], p)
		if p.pid == self || p.state == 'Z' {
			continue
		}
		cl := cmdline(p.pid)
		if strings.Contains(cl, BaseDir) || strings.Contains(cl, RunDir) {
			roots = append(roots, p)
		}
	}
	seen := map[int]bool{}
	var out []procInfo
	var walk func(p procInfo)
	walk = func(p procInfo) {
		if seen[p.pid] {
			return
		}
		seen[p.pid] = true
		if p.state != 'Z' {
			out = append(out, p)
		}
		for _, c := range children[p.pid] {
			walk(c)
		}
	}
	for _, r := range roots {
		walk(r)
	}
	return out
}
