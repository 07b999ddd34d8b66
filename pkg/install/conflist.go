package install

// The conflist files: find the node's primary CNI configuration in a directory the way
// kubelet and libcni do, and install, check and remove meshcni's entry there
// (InstallConflist, CheckConflist, UninstallConflist). The entry itself is pure
// pkg/cniconf, which is all the plugin needs.

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"

	"github.com/containernetworking/cni/libcni"

	"github.com/meshcni/meshcni/pkg/cniconf"
	"github.com/meshcni/meshcni/pkg/fileutil"
)

// Extensions are the configuration file extensions kubelet and the runtimes load.
var Extensions = []string{".conf", ".conflist", ".json"}

// ErrNoPrimary: the configuration directory holds no valid configuration (yet).
var ErrNoPrimary = errors.New("no primary CNI configuration")

// ErrChanged: a file changed while it was being rewritten; the write was abandoned.
var ErrChanged = errors.New("file changed concurrently")

// ErrInvalid: a configuration file cannot be loaded (truncated or half-written JSON, an
// empty file) and is left alone: the named primary (Install, Check) or a list that may
// hold meshcni's entry unseen (Uninstall).
var ErrInvalid = errors.New("invalid CNI configuration")

// invalidError is ErrInvalid for one file, with libcni's reason.
type invalidError struct {
	path string
	err  error
}

func (e *invalidError) Error() string {
	return fmt.Sprintf("CNI configuration %s is invalid: %v", e.path, e.err)
}
func (e *invalidError) Unwrap() error        { return e.err }
func (e *invalidError) Is(target error) bool { return target == ErrInvalid }

// Options say where and how meshcni's configuration goes.
type ConflistOptions struct {
	// Dir is the CNI configuration directory (kubelet's --cni-conf-dir).
	Dir string
	// FileName, when not empty, names the primary configuration file instead of the
	// lexically first valid one.
	FileName string
	// Chained injects Entry into the primary configuration; otherwise meshcni writes
	// its own list, StandaloneFile.
	Chained bool
	// StandaloneFile is the file name of the standalone list (default meshcni.conflist).
	StandaloneFile string
	// NetworkName is the standalone list's network name, the name Multus looks it up by
	// (default meshcni; istio-cni answers the network Istio's injector asks for).
	NetworkName string
	// Entry is meshcni's plugin entry.
	Entry cniconf.PluginEntry
}

func (o ConflistOptions) standalonePath() string {
	name := o.StandaloneFile
	if name == "" {
		name = "meshcni.conflist"
	}
	return filepath.Join(o.Dir, name)
}

// ValidList reports whether data is a configuration list libcni would load: kubelet and
// the container runtimes skip files for which this fails.
func ValidList(data []byte) error {
	list, err := libcni.NetworkConfFromBytes(data)
	if err != nil {
		return err
	}
	if len(list.Plugins) == 0 {
		return errors.New("no plugin configs found")
	}
	return nil
}

// ValidConf reports whether data is a single-plugin configuration (.conf, .json) libcni
// would load.
func ValidConf(data []byte) error {
	_, err := libcni.NetworkPluginConfFromBytes(data)
	return err
}

// Primary is a configuration file as read, with the identity of what was read.
type Primary struct {
	Path   string
	Data   []byte
	IsList bool
	Mode   fs.FileMode
	id     fileID
}

// Skipped is a configuration file passed over because libcni would not load it. Every
// skipped file sorts before the primary (or is the named primary): the runtime reads
// it first. containerd's CRI then loads no network at all (go-cni fails on the first
// file it cannot parse, so no pod starts); CRI-O skips it and uses the next valid
// file.
type Skipped struct {
	Path string
	Err  error
}

func idOf(fi fs.FileInfo) fileID {
	id := fileID{size: fi.Size(), mtime: fi.ModTime().UnixNano()}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		id.dev, id.ino = uint64(st.Dev), st.Ino
	}
	return id
}

// maxConfigSize bounds what is read of one configuration file: real lists are a few
// KiB; a larger file is skipped, not read into memory.
const maxConfigSize = 1 << 20

// errNotRegular and errTooLarge make a file unloadable (ErrUnloadable): it is
// skipped like a file libcni rejects.
var (
	ErrUnloadable = errors.New("not a loadable configuration file")
	errNotRegular = fmt.Errorf("%w: not a regular file", ErrUnloadable)
	errTooLarge   = fmt.Errorf("%w: larger than %d bytes", ErrUnloadable, maxConfigSize)
)

// ReadConfig reads a configuration file as the agent does: never blocking on a FIFO
// or device, at most 1 MiB (errors.Is(err, ErrUnloadable) otherwise).
func ReadConfig(path string) ([]byte, error) {
	data, _, _, err := readFile(path)
	return data, err
}

// readFile reads a configuration file without ever blocking on it or reading it
// without bound: symlinks are followed (as kubelet follows them), but the file is
// opened non-blocking and must be a regular file of at most maxConfigSize bytes
// (a FIFO or device named *.conflist is refused, not opened for a read that waits).
func readFile(path string) (data []byte, mode fs.FileMode, id fileID, err error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK|syscall.O_NOCTTY, 0)
	if err != nil {
		return nil, 0, id, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, 0, id, err
	}
	if !fi.Mode().IsRegular() {
		return nil, 0, id, fmt.Errorf("%s: %w (%s)", path, errNotRegular, fi.Mode().Type())
	}
	if fi.Size() > maxConfigSize {
		return nil, 0, id, fmt.Errorf("%s: %w", path, errTooLarge)
	}
	data, err = io.ReadAll(io.LimitReader(f, maxConfigSize+1))
	if err == nil && len(data) > maxConfigSize {
		err = fmt.Errorf("%s: %w", path, errTooLarge)
	}
	return data, fi.Mode().Perm(), idOf(fi), err
}

// unloadable reports a read error that makes a file one to skip, not a failure.
func unloadable(err error) bool { return errors.Is(err, ErrUnloadable) }

// ListFiles returns the configuration files of dir in the order kubelet tries them.
// A missing directory holds no files.
func ListFiles(dir string) ([]string, error) {
	files, err := libcni.ConfFiles(dir, Extensions)
	if err != nil {
		return nil, fmt.Errorf("list CNI configuration directory %s: %w", dir, err)
	}
	if files == nil {
		if _, err := os.Stat(dir); err != nil {
			return nil, fmt.Errorf("CNI configuration directory: %w", err)
		}
	}
	slices.Sort(files)
	return files, nil
}

// FindPrimary returns the configuration kubelet would use: the file fileName when it
// is set, else the lexically first file in dir that libcni loads. Files it passes over
// are returned in skipped. It returns ErrNoPrimary when there is none, and an
// ErrInvalid (the file in skipped) when the named file cannot be loaded.
func FindPrimary(dir, fileName string) (p *Primary, skipped []Skipped, err error) {
	var files []string
	if fileName != "" {
		files = []string{filepath.Join(dir, fileName)}
		if _, err := os.Stat(dir); err != nil {
			return nil, nil, fmt.Errorf("CNI configuration directory: %w", err)
		}
	} else if files, err = ListFiles(dir); err != nil {
		return nil, nil, err
	}
	for _, path := range files {
		data, mode, id, err := readFile(path)
		if errors.Is(err, fs.ErrNotExist) {
			continue // removed since listed
		}
		if unloadable(err) {
			skipped = append(skipped, Skipped{Path: path, Err: err})
			if fileName != "" {
				return nil, skipped, &invalidError{path, err}
			}
			continue
		}
		if err != nil {
			return nil, skipped, fmt.Errorf("read CNI configuration: %w", err)
		}
		isList := strings.HasSuffix(path, ".conflist")
		if isList {
			err = ValidList(data)
		} else {
			err = ValidConf(data)
		}
		if err != nil {
			skipped = append(skipped, Skipped{Path: path, Err: err})
			if fileName != "" {
				return nil, skipped, &invalidError{path, err}
			}
			continue
		}
		return &Primary{Path: path, Data: data, IsList: isList, Mode: mode, id: id}, skipped, nil
	}
	return nil, skipped, fmt.Errorf("%w in %s", ErrNoPrimary, dir)
}

// Result says what Install did.
type ConflistResult struct {
	// Path is the file holding meshcni's entry.
	Path string
	// Changed: a file was written.
	Changed bool
	// Missing: the entry was absent before (a first install or a re-injection).
	Missing bool
	// Converted is the single-configuration file replaced by Path, if any.
	Converted string
	// Cleaned are other files a stale meshcni entry was removed from.
	Cleaned []string
	// Skipped are files libcni would not load, read by the runtime before Path. While
	// there are any, Install writes only Path (and never a skipped file): it cleans and
	// converts nothing else, so the last good state stays as it is.
	Skipped []Skipped
}

// Install puts meshcni's entry in place: injected into the primary configuration
// (chained) or as its own list (standalone). It writes nothing when all is in place.
// On ErrChanged (the primary was rewritten under it) it retries a few times.
//
// A file that sorts before the primary and does not load (Result.Skipped) is never
// written: the entry goes into the next valid file, the one CRI-O uses meanwhile
// (containerd starts no pod while the broken file sorts first), and other files keep
// their entries until the broken one is valid again. A named primary that does not
// load is an ErrInvalid, and nothing is written.
func InstallConflist(o ConflistOptions) (ConflistResult, error) {
	if err := o.Entry.Validate(); err != nil {
		return ConflistResult{}, err
	}
	if !o.Chained {
		return installStandalone(o)
	}
	var res ConflistResult
	var err error
	for range 5 {
		res, err = installChained(o)
		if !errors.Is(err, ErrChanged) {
			break
		}
	}
	return res, err
}

func installStandalone(o ConflistOptions) (ConflistResult, error) {
	path := o.standalonePath()
	name := o.NetworkName
	if name == "" {
		name = cniconf.PluginType
	}
	want, err := cniconf.Standalone(name, o.Entry)
	if err != nil {
		return ConflistResult{}, err
	}
	res := ConflistResult{Path: path}
	have, _, _, err := readFile(path)
	if err == nil && bytes.Equal(have, want) {
		return res, nil
	}
	if err != nil && !errors.Is(err, fs.ErrNotExist) && !unloadable(err) {
		return res, fmt.Errorf("read %s: %w", path, err)
	}
	res.Missing = err != nil || cniconf.CheckEntry(have, o.Entry) != nil
	if err := fileutil.WriteFileAtomic(path, want, 0o644); err != nil {
		return res, err
	}
	res.Changed = true
	return res, nil
}

func installChained(o ConflistOptions) (ConflistResult, error) {
	p, skipped, err := FindPrimary(o.Dir, o.FileName)
	res := ConflistResult{Skipped: skipped}
	if err != nil {
		return res, err
	}
	res.Path = p.Path
	if p.IsList {
		err := cniconf.CheckEntry(p.Data, o.Entry)
		if err == nil {
			if len(skipped) == 0 {
				res.Cleaned, err = cleanOthers(o.Dir, p.Path)
			}
			return res, err
		}
		res.Missing = errors.Is(err, cniconf.ErrNoEntry)
	} else {
		res.Missing = true
	}
	base := strings.TrimSuffix(filepath.Base(p.Path), filepath.Ext(p.Path))
	out, err := cniconf.Inject(p.Data, p.IsList, base, o.Entry)
	if err != nil {
		return res, fmt.Errorf("inject into %s: %w", p.Path, err)
	}
	target := p.Path
	if !p.IsList {
		target = filepath.Join(o.Dir, base+".conflist")
	}
	if err := writeIfUnchanged(target, out, p); err != nil {
		return res, err
	}
	res.Path, res.Changed = target, true
	if !p.IsList {
		if err := os.Remove(p.Path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return res, fmt.Errorf("remove converted %s: %w", p.Path, err)
		}
		res.Converted = p.Path
	}
	if len(skipped) == 0 {
		res.Cleaned, err = cleanOthers(o.Dir, target)
	}
	return res, err
}

// writeIfUnchanged writes data to target, the file read as p keeping its mode, unless
// p's file changed since it was read.
func writeIfUnchanged(target string, data []byte, p *Primary) error {
	return fileutil.WriteAtomic(target, bytes.NewReader(data), p.Mode, func() error {
		fi, err := os.Stat(p.Path)
		if err != nil || idOf(fi) != p.id {
			return fmt.Errorf("%s: %w", p.Path, ErrChanged)
		}
		return nil
	})
}

// cleanOthers removes meshcni entries from the configuration lists of dir other than
// keep (left over from a file that was the primary before).
func cleanOthers(dir, keep string) ([]string, error) {
	cleaned, _, err := removeEntries(dir, keep)
	return cleaned, err
}

// removeEntries removes meshcni entries from the lists of dir other than keep. It
// returns the files it changed, and unseen: lists it left alone that do not parse at
// all, so may hold an entry it cannot see.
func removeEntries(dir, keep string) (cleaned, unseen []string, err error) {
	files, err := ListFiles(dir)
	if err != nil {
		return nil, nil, err
	}
	var errs []error
	for _, path := range files {
		if path == keep || !strings.HasSuffix(path, ".conflist") {
			continue
		}
		data, mode, id, err := readFile(path)
		if err != nil {
			continue
		}
		if ValidList(data) != nil {
			if !json.Valid(data) {
				unseen = append(unseen, path)
			}
			continue
		}
		out, n, err := cniconf.Remove(data)
		if err != nil || n == 0 {
			continue
		}
		p := &Primary{Path: path, Mode: mode, id: id}
		if err := writeIfUnchanged(path, out, p); err != nil {
			errs = append(errs, err)
			continue
		}
		cleaned = append(cleaned, path)
	}
	return cleaned, unseen, errors.Join(errs...)
}

// Uninstall removes meshcni's configuration: the standalone list, or every meshcni
// entry from the lists in the directory. It returns the files it changed or removed.
// A list that does not parse is left alone and named in an ErrInvalid: it may hold an
// entry that will need the plugin once the file is whole again.
func UninstallConflist(o ConflistOptions) ([]string, error) {
	if !o.Chained {
		path := o.standalonePath()
		if err := os.Remove(path); err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil, nil
			}
			return nil, fmt.Errorf("remove %s: %w", path, err)
		}
		return []string{path}, nil
	}
	changed, unseen, err := removeEntries(o.Dir, "")
	if len(unseen) > 0 {
		err = errors.Join(err, fmt.Errorf("%w: %s left alone (it does not parse, so it may hold meshcni's entry)", ErrInvalid, strings.Join(unseen, ", ")))
	}
	return changed, err
}

// Check returns the file holding meshcni's entry, or why it is not in place: a live
// check for readiness.
func CheckConflist(o ConflistOptions) (string, error) {
	if !o.Chained {
		path := o.standalonePath()
		data, _, _, err := readFile(path)
		if err != nil {
			return path, err
		}
		return path, cniconf.CheckEntry(data, o.Entry)
	}
	p, _, err := FindPrimary(o.Dir, o.FileName)
	if err != nil {
		return "", err
	}
	if !p.IsList {
		return p.Path, fmt.Errorf("%s: %w (a single configuration, not converted)", p.Path, cniconf.ErrNoEntry)
	}
	if err := cniconf.CheckEntry(p.Data, o.Entry); err != nil {
		return p.Path, fmt.Errorf("%s: %w", p.Path, err)
	}
	return p.Path, nil
}
