package microvm

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/opendsec/internal/atomicfile"
)

// The image's own kernel [ours; the vm backend]. An image that carries a
// kernel (/boot/vmlinuz-RELEASE with its modules in /usr/lib/modules/
// RELEASE, as Debian's linux-image packages install them) boots it on
// q35 instead of the node's guest kernel: its modules, its version, its
// configuration. The node takes, once per image, the kernel and the
// modules the guest's init loads (ext4, virtio's, overlay, erofs, with
// what they depend on by the image's modules.dep, decompressed) into
// kernels/KEY of the backend's state; the guest needs no modules disk,
// having its own. The image is anyone's: its files are opened inside its
// tree without following a link, regular files only, and bounded in size
// and number. A kernel that lacks what the init needs (checked against
// its modules.builtin and modules.dep), or whose files cannot be taken,
// is not booted: the image's guests boot the node's kernel and the node
// logs why once. A snapshot of such a guest keeps the kernel it boots, so
// that a node which never ran the image's guests restores it.

// bootKernel is the kernel a guest boots and the modules its initramfs
// carries for it.
type bootKernel struct {
	// Path is the kernel image (PVH vmlinux or bzImage); Image says it
	// is an image's own.
	Path  string `json:"path"`
	Image bool   `json:"image,omitempty"`
	// ModulesDir holds NAME.ko of each module of Order, OrderNet.
	ModulesDir string `json:"modules_dir"`
	// Order and OrderNet are the modules the init loads, in their load
	// order, without and with a NIC.
	Order    []string `json:"order"`
	OrderNet []string `json:"order_net"`
}

// modules is the load order of a guest with or without a NIC.
func (k *bootKernel) modules(net bool) []string {
	if net {
		return k.OrderNet
	}
	return k.Order
}

// nodeKernel is the node's guest kernel for q's guests.
func (q *QEMU) nodeKernel() *bootKernel {
	return &bootKernel{Path: q.Kernel, ModulesDir: q.Modules, Order: q.modules(false), OrderNet: q.modules(true)}
}

// kernelFor is the kernel a guest of layers boots: on q35 the image's own
// when it has one this node can boot, else the node's.
func (b *Backend) kernelFor(ctx context.Context, layers []string) (*bootKernel, error) {
	if !b.qemu.pci() {
		return b.qemu.nodeKernel(), nil
	}
	want := append(append([]string{}, imageKernelModules...), b.qemu.moduleOrder()...)
	// The key names what is taken: a release of this code that loads
	// other modules takes the kernel again.
	sum := sha256.Sum256([]byte(strings.Join(layers, "\n") + "\x00" + strings.Join(want, ",") + "\x00" + strings.Join(NetModules, ",")))
	key := hex.EncodeToString(sum[:16])
	dir := filepath.Join(b.cfg.StateDir, "kernels", key)
	l := b.rootLock("kernel-" + key)
	l.Lock()
	defer l.Unlock()
	now := time.Now()
	if k, err := loadBootKernel(dir); err == nil {
		return k, os.Chtimes(dir, now, now) // its last use, which pruneKernels counts from
	}
	if _, err := os.Stat(filepath.Join(dir, noKernelFile)); err == nil {
		return b.qemu.nodeKernel(), os.Chtimes(dir, now, now)
	}
	tree, done, err := b.mergeLayers(layers)
	if err != nil {
		return nil, err
	}
	defer done()
	os.RemoveAll(dir) //nolint:errcheck // a take cut short; made anew below
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	release := findImageKernel(tree)
	why := "the image has no kernel of its own"
	if release != "" {
		needs := append([]string{}, imageKernelNeeds...)
		if b.rootStore != "" && b.sharedWhy == "" {
			needs = append(needs, "erofs") // roots shared through the image store
		}
		k, err := takeImageKernel(ctx, tree, release, dir, want, NetModules, needs)
		if err == nil {
			b.log.Info("the image's own kernel taken for its guests", "release", release, "modules", len(k.OrderNet))
			return k, nil
		}
		if ctx.Err() != nil {
			return nil, err
		}
		// Its guests boot the node's kernel, as an image's without one:
		// the reason is logged once and kept beside the node's choice.
		why = err.Error()
		b.log.Warn("the image's own kernel is not used: its guests boot the node's", "release", release, "why", why)
		os.RemoveAll(dir) //nolint:errcheck // remade for the marker
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return nil, err
		}
	}
	return b.qemu.nodeKernel(), os.WriteFile(filepath.Join(dir, noKernelFile), []byte(why+"\n"), 0o600)
}

// pruneKernels removes what was taken of images' kernels (and the notes
// of images without one) that no running guest boots and no create used
// within grace. A snapshot of such a guest restores again after the next
// create of its image takes the kernel back (to the same path).
func (b *Backend) pruneKernels(grace time.Duration) (int64, error) {
	dir := filepath.Join(b.cfg.StateDir, "kernels")
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	inUse := map[string]bool{}
	b.mu.Lock()
	boxes := make([]*box, 0, len(b.boxes))
	for _, bx := range b.boxes {
		boxes = append(boxes, bx)
	}
	b.mu.Unlock()
	for _, bx := range boxes {
		if g, err := bx.loadGuest(); err == nil && g.Kernel != "" {
			inUse[filepath.Dir(g.Kernel)] = true
		}
	}
	var freed int64
	var errs []error
	for _, ent := range ents {
		path := filepath.Join(dir, ent.Name())
		l := b.rootLock("kernel-" + ent.Name())
		l.Lock()
		fi, err := os.Stat(path)
		if err == nil && !inUse[path] && time.Since(fi.ModTime()) >= grace {
			n := dirBytes(path)
			if err := os.RemoveAll(path); err != nil {
				errs = append(errs, err)
			} else {
				freed += n
			}
		}
		l.Unlock()
	}
	return freed, errors.Join(errs...)
}

// dirBytes is the disk space of the files under dir.
func dirBytes(dir string) int64 {
	var n int64
	filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error { //nolint:errcheck // a count
		if err == nil && d.Type().IsRegular() {
			if fi, err := d.Info(); err == nil {
				if st, ok := fi.Sys().(*syscall.Stat_t); ok {
					n += st.Blocks * 512
				}
			}
		}
		return nil
	})
	return n
}

// imageKernelModules are loaded before the node kernel's list for an
// image's kernel, which (as distributions build them) may have as modules
// what the node's has built in: the root and writable disks' ext4, and
// the checksum it asks the crypto API for.
var imageKernelModules = []string{"crc32c_generic", "crc32c_intel", "ext4"}

// imageKernelNeeds are what the guest's init cannot do without: an
// image's kernel that neither builds one in nor has it as a module is not
// booted.
var imageKernelNeeds = []string{"virtio_pci", "virtio_console", "virtio_blk", "ext4", "overlay"}

// Bounds of what is taken of an image's kernel (its files are the
// image's, which is anyone's): the largest distribution kernels and
// modules are a fraction of these.
const (
	maxKernelBytes     = 128 << 20
	maxModuleBytes     = 64 << 20
	maxModulesBytes    = 256 << 20
	maxModules         = 64
	maxModulesDepBytes = 16 << 20
)

const (
	kernelFile   = "kernel.json"
	noKernelFile = "none" // why the image's guests boot the node's kernel
)

func loadBootKernel(dir string) (*bootKernel, error) {
	data, err := os.ReadFile(filepath.Join(dir, kernelFile))
	if err != nil {
		return nil, err
	}
	var k bootKernel
	if err := json.Unmarshal(data, &k); err != nil {
		return nil, err
	}
	if _, err := os.Stat(k.Path); err != nil {
		return nil, err
	}
	return &k, nil
}

// findImageKernel is the release of the image's newest /boot/vmlinuz-
// RELEASE that has its modules directory, or "": regular files and
// directories only, no link followed.
func findImageKernel(tree string) string {
	if fi, err := os.Lstat(filepath.Join(tree, "boot")); err != nil || !fi.IsDir() {
		return ""
	}
	ents, _ := os.ReadDir(filepath.Join(tree, "boot"))
	var releases []string
	for _, e := range ents {
		rel, ok := strings.CutPrefix(e.Name(), "vmlinuz-")
		if !ok || !e.Type().IsRegular() || rel == "" {
			continue
		}
		if modulesDirOf(tree, rel) != "" {
			releases = append(releases, rel)
		}
	}
	if len(releases) == 0 {
		return ""
	}
	slices.SortFunc(releases, compareVersions)
	return releases[len(releases)-1]
}

// compareVersions orders releases as versions: runs of digits by their
// value (6.12.10 after 6.12.9), the rest by bytes.
func compareVersions(a, b string) int {
	for a != "" && b != "" {
		ad, bd := digitsPrefix(a), digitsPrefix(b)
		switch {
		case ad != "" && bd != "":
			x, y := strings.TrimLeft(ad, "0"), strings.TrimLeft(bd, "0")
			if c := cmp.Compare(len(x), len(y)); c != 0 {
				return c
			}
			if c := strings.Compare(x, y); c != 0 {
				return c
			}
			a, b = a[len(ad):], b[len(bd):]
		default:
			if a[0] != b[0] {
				return cmp.Compare(a[0], b[0])
			}
			a, b = a[1:], b[1:]
		}
	}
	return cmp.Compare(len(a), len(b))
}

func digitsPrefix(s string) string {
	i := 0
	for i < len(s) && s[i] >= '0' && s[i] <= '9' {
		i++
	}
	return s[:i]
}

// modulesDirOf is the tree-relative modules directory of release ("" if
// none): usr/lib/modules (merged /usr), or lib/modules where lib is a
// directory.
func modulesDirOf(tree, release string) string {
	for _, parts := range [][]string{{"usr", "lib", "modules", release}, {"lib", "modules", release}} {
		p := tree
		ok := true
		for _, part := range parts {
			p = filepath.Join(p, part)
			if fi, err := os.Lstat(p); err != nil || !fi.IsDir() {
				ok = false
				break
			}
		}
		if ok {
			return filepath.Join(parts...)
		}
	}
	return ""
}

// imageFiles opens files of an image's tree by tree-relative path, never
// through a symbolic link (openat2 RESOLVE_NO_SYMLINKS, inside the tree),
// and regular files only.
type imageFiles struct{ root *os.File }

func openImageFiles(tree string) (*imageFiles, error) {
	f, err := os.Open(tree)
	if err != nil {
		return nil, err
	}
	return &imageFiles{root: f}, nil
}

func (t *imageFiles) Close() error { return t.root.Close() }

func (t *imageFiles) open(rel string) (*os.File, error) {
	fd, err := unix.Openat2(int(t.root.Fd()), rel, &unix.OpenHow{
		Flags:   unix.O_RDONLY | unix.O_CLOEXEC | unix.O_NOFOLLOW,
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS,
	})
	if err != nil {
		return nil, fmt.Errorf("/%s: %w (no link is followed in an image's kernel)", rel, err)
	}
	f := os.NewFile(uintptr(fd), rel)
	if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() {
		f.Close()
		return nil, fmt.Errorf("/%s: not a regular file", rel)
	}
	return f, nil
}

// readAll reads rel, refusing more than limit bytes.
func (t *imageFiles) readAll(rel string, limit int64) ([]byte, error) {
	f, err := t.open(rel)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err == nil && int64(len(data)) > limit {
		err = fmt.Errorf("/%s: more than %d bytes", rel, limit)
	}
	return data, err
}

// takeImageKernel copies the image's kernel of release into dir and the
// modules of want and wantNet (with theirs, by the image's modules.dep)
// into dir/modules, decompressed, and writes dir's kernel.json. Each of
// needs must be among them or built into the kernel (modules.builtin).
func takeImageKernel(ctx context.Context, tree, release, dir string, want, wantNet, needs []string) (*bootKernel, error) {
	files, err := openImageFiles(tree)
	if err != nil {
		return nil, err
	}
	defer files.Close()
	modDir := modulesDirOf(tree, release)
	dep, err := files.readAll(filepath.Join(modDir, "modules.dep"), maxModulesDepBytes)
	if err != nil {
		return nil, err
	}
	deps, paths := parseModulesDep(dep)
	builtin := map[string]bool{}
	if data, err := files.readAll(filepath.Join(modDir, "modules.builtin"), maxModulesDepBytes); err == nil {
		for _, line := range strings.Fields(string(data)) {
			builtin[moduleName(line)] = true
		}
	}
	k := &bootKernel{Path: filepath.Join(dir, "vmlinuz"), Image: true, ModulesDir: filepath.Join(dir, "modules")}
	k.Order = loadOrder(want, deps, paths)
	k.OrderNet = loadOrder(append(append([]string{}, want...), wantNet...), deps, paths)
	for _, m := range needs {
		if !builtin[m] && !slices.Contains(k.Order, m) {
			return nil, fmt.Errorf("it has no %s, built in or as a module (the guest's init needs it)", m)
		}
	}
	if len(k.OrderNet) > maxModules {
		return nil, fmt.Errorf("%d modules to load, more than %d", len(k.OrderNet), maxModules)
	}
	if err := os.MkdirAll(k.ModulesDir, 0o700); err != nil {
		return nil, err
	}
	budget := int64(maxModulesBytes)
	for _, m := range k.OrderNet {
		n, err := decompressModule(ctx, files, filepath.Join(modDir, paths[m]), filepath.Join(k.ModulesDir, m+".ko"), min(budget, maxModuleBytes))
		if err != nil {
			return nil, fmt.Errorf("module %s: %w", m, err)
		}
		budget -= n
	}
	kernel, err := files.open(filepath.Join("boot", "vmlinuz-"+release))
	if err != nil {
		return nil, err
	}
	defer kernel.Close()
	if _, err := writeLimited(k.Path, kernel, maxKernelBytes); err != nil {
		return nil, fmt.Errorf("the kernel: %w", err)
	}
	data, _ := json.Marshal(k)
	return k, atomicfile.Write(filepath.Join(dir, kernelFile), data, 0o600)
}

// moduleName is a module's name from its file (dashes as underscores, as
// the kernel names them).
func moduleName(file string) string {
	base := filepath.Base(file)
	for _, ext := range []string{".xz", ".zst", ".gz"} {
		base = strings.TrimSuffix(base, ext)
	}
	return strings.ReplaceAll(strings.TrimSuffix(base, ".ko"), "-", "_")
}

// parseModulesDep parses depmod's modules.dep: each module's dependencies
// by name (modprobe loads them last first) and its file, relative to the
// modules directory; entries outside it are left out.
func parseModulesDep(data []byte) (deps map[string][]string, files map[string]string) {
	deps, files = map[string][]string{}, map[string]string{}
	for _, line := range strings.Split(string(data), "\n") {
		file, rest, ok := strings.Cut(line, ":")
		if !ok || !filepath.IsLocal(file) {
			continue
		}
		name := moduleName(file)
		files[name] = file
		for _, d := range strings.Fields(rest) {
			deps[name] = append(deps[name], moduleName(d))
		}
	}
	return deps, files
}

// loadOrder is want's modules that are modules (not built in: absent
// from modules.dep) with their dependencies, each after what it needs.
func loadOrder(want []string, deps map[string][]string, files map[string]string) []string {
	var out []string
	seen := map[string]bool{}
	var add func(m string, depth int)
	add = func(m string, depth int) {
		if seen[m] || files[m] == "" || depth > 32 {
			return
		}
		seen[m] = true
		d := deps[m]
		for i := len(d) - 1; i >= 0; i-- {
			add(d[i], depth+1)
		}
		out = append(out, m)
	}
	for _, m := range want {
		add(m, 0)
	}
	return out
}

// decompressModule writes the image's module rel (a .ko, or .ko.xz, .zst
// or .gz) to dst as a plain module of at most limit bytes, and returns its
// size.
func decompressModule(ctx context.Context, files *imageFiles, rel, dst string, limit int64) (int64, error) {
	src, err := files.open(rel)
	if err != nil {
		return 0, err
	}
	defer src.Close()
	tool := map[string]string{".xz": "xz", ".zst": "zstd", ".gz": "gzip"}[filepath.Ext(rel)]
	if filepath.Ext(rel) == ".ko" {
		return writeLimited(dst, src, limit)
	}
	if tool == "" {
		return 0, fmt.Errorf("/%s: unknown compression", rel)
	}
	cmd := exec.CommandContext(ctx, tool, "-dc")
	cmd.Stdin = src
	out, err := cmd.StdoutPipe()
	if err != nil {
		return 0, err
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		return 0, fmt.Errorf("%s: %w (Debian's %s package)", tool, err, map[string]string{"xz": "xz-utils", "zstd": "zstd", "gzip": "gzip"}[tool])
	}
	n, err := writeLimited(dst, out, limit)
	if err != nil {
		cmd.Process.Kill() //nolint:errcheck // reporting err
		cmd.Wait()         //nolint:errcheck // reporting err
		return 0, err
	}
	if err := cmd.Wait(); err != nil {
		return 0, fmt.Errorf("%s -dc /%s: %v: %s", tool, rel, err, strings.TrimSpace(stderr.String()))
	}
	return n, nil
}

// writeLimited writes r to dst (made anew), refusing more than limit
// bytes, and returns how many it wrote.
func writeLimited(dst string, r io.Reader, limit int64) (int64, error) {
	w, err := os.OpenFile(dst, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return 0, err
	}
	n, err := io.Copy(w, io.LimitReader(r, limit+1))
	if cerr := w.Close(); err == nil {
		err = cerr
	}
	if err == nil && n > limit {
		err = fmt.Errorf("more than %d bytes", limit)
	}
	return n, err
}
