package istio

import (
	"debug/elf"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
)

// The host's iptables that goes into the proxyv2 image, so that Istio's own
// pilot-agent can run `istio-iptables` in an istio-init container (the injector's
// non-CNI mode) exactly as in Istio's proxyv2 image, which carries iptables 1.8 with
// both the nf_tables and the legacy variants and `iptables` pointing at nf_tables.
const (
	xtablesNft    = "/usr/sbin/xtables-nft-multi"
	xtablesLegacy = "/usr/sbin/xtables-legacy-multi"
	// XtablesLibDir is where iptables loads its extensions from (compiled in).
	XtablesLibDir = "/usr/lib/x86_64-linux-gnu/xtables"
)

// libDirs are searched, in order, for a shared library a binary needs (the dynamic
// loader's system search path on Debian amd64); the image holds a library at the
// path it was found at.
var libDirs = []string{"/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib", "/usr/lib"}

// iptablesNames are the commands of each multi-call binary (it acts on its argv[0]).
// The image has copies, not links: ociimage writes regular files only.
var iptablesNames = map[string][]string{
	xtablesNft: {
		"iptables", "iptables-save", "iptables-restore", "ip6tables", "ip6tables-save", "ip6tables-restore",
		"iptables-nft", "iptables-nft-save", "iptables-nft-restore",
		"ip6tables-nft", "ip6tables-nft-save", "ip6tables-nft-restore",
	},
	xtablesLegacy: {
		"iptables-legacy", "iptables-legacy-save", "iptables-legacy-restore",
		"ip6tables-legacy", "ip6tables-legacy-save", "ip6tables-legacy-restore",
	},
}

// IptablesFiles maps paths in the proxyv2 image to the host files that make the
// host's iptables run there: both multi-call binaries under every command name in
// /usr/sbin, the IPv4/IPv6/xt extensions, every shared library they need (found by
// their ELF dynamic sections) and the dynamic loader.
func IptablesFiles() (map[string]string, error) {
	files := map[string]string{}
	var elfs []string
	for bin, names := range iptablesNames {
		if _, err := os.Stat(bin); err != nil {
			return nil, fmt.Errorf("iptables for the proxyv2 image: %w (install the iptables package)", err)
		}
		files[bin] = bin
		for _, n := range names {
			files["/usr/sbin/"+n] = bin
		}
		elfs = append(elfs, bin)
	}
	exts, err := extensions()
	if err != nil {
		return nil, err
	}
	for _, e := range exts {
		files[e] = e
	}
	elfs = append(elfs, exts...)
	if err := addLibraries(files, elfs); err != nil {
		return nil, fmt.Errorf("iptables for the proxyv2 image: %w", err)
	}
	return files, nil
}

// extensions lists the xt, ipt and ip6t extension modules (not arp/eb tables); an
// alias (libxt_REDIRECT.so → libxt_NAT.so) is listed under its own name.
func extensions() ([]string, error) {
	ents, err := os.ReadDir(XtablesLibDir)
	if err != nil {
		return nil, fmt.Errorf("iptables extensions: %w", err)
	}
	var out []string
	for _, e := range ents {
		n := e.Name()
		if (e.Type().IsRegular() || e.Type()&fs.ModeSymlink != 0) && strings.HasSuffix(n, ".so") &&
			(strings.HasPrefix(n, "libxt_") || strings.HasPrefix(n, "libipt_") || strings.HasPrefix(n, "libip6t_")) {
			out = append(out, path.Join(XtablesLibDir, n))
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("iptables extensions: none in %s", XtablesLibDir)
	}
	return out, nil
}

// addLibraries adds the interpreter and the needed libraries of every ELF file,
// transitively.
func addLibraries(files map[string]string, queue []string) error {
	seen := map[string]bool{}
	for len(queue) > 0 {
		f := queue[0]
		queue = queue[1:]
		if seen[f] {
			continue
		}
		seen[f] = true
		interp, needed, err := dynamic(f)
		if err != nil {
			return err
		}
		if interp != "" {
			real, err := filepath.EvalSymlinks(interp)
			if err != nil {
				return fmt.Errorf("interpreter of %s: %w", f, err)
			}
			files[interp] = real
		}
		for _, lib := range needed {
			found, err := findLibrary(lib)
			if err != nil {
				return fmt.Errorf("%s needs %s: %w", f, lib, err)
			}
			files[found] = found
			queue = append(queue, found)
		}
	}
	return nil
}

// dynamic reads an ELF file's interpreter (PT_INTERP) and needed libraries.
func dynamic(file string) (interp string, needed []string, err error) {
	ef, err := elf.Open(file)
	if err != nil {
		return "", nil, fmt.Errorf("read ELF %s: %w", file, err)
	}
	defer ef.Close()
	for _, p := range ef.Progs {
		if p.Type != elf.PT_INTERP {
			continue
		}
		b := make([]byte, p.Filesz)
		if _, err := p.ReadAt(b, 0); err != nil {
			return "", nil, fmt.Errorf("read interpreter of %s: %w", file, err)
		}
		interp = strings.TrimRight(string(b), "\x00")
	}
	needed, err = ef.ImportedLibraries()
	if err != nil {
		return "", nil, fmt.Errorf("needed libraries of %s: %w", file, err)
	}
	return interp, slices.Sorted(slices.Values(needed)), nil
}

func findLibrary(name string) (string, error) {
	if strings.Contains(name, "/") {
		return "", fmt.Errorf("library name %q has a slash", name)
	}
	for _, d := range libDirs {
		p := path.Join(d, name)
		if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() {
			return p, nil
		} else if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return "", err
		}
	}
	return "", fmt.Errorf("not found in %s", strings.Join(libDirs, ", "))
}
