package microvm

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"

	"github.com/opendsec/opendsec/internal/atomicfile"
	"github.com/opendsec/opendsec/internal/sparsefile"
)

// The image's own kernel [ours; the vm backend]. An image that carries a
// kernel (/boot/vmlinuz-RELEASE with its modules in /usr/lib/modules/
// RELEASE, as Debian's linux-image packages install them) boots it on
// q35 instead of the node's guest kernel: its modules, its version, its
// configuration. The node takes, once per image, the kernel and the
// modules the guest's init loads (virtio's, overlay, erofs, with what
// they depend on by the image's modules.dep, decompressed) into
// kernels/KEY of the backend's state; the guest needs no modules disk,
// having its own. Cross-node restores of such guests need the image's
// kernel taken on that node too: they are not done yet.

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
// when it has one, else the node's.
func (b *Backend) kernelFor(ctx context.Context, layers []string) (*bootKernel, error) {
	if !b.qemu.pci() {
		return b.qemu.nodeKernel(), nil
	}
	sum := sha256.Sum256([]byte(strings.Join(layers, "\n")))
	key := hex.EncodeToString(sum[:16])
	dir := filepath.Join(b.cfg.StateDir, "kernels", key)
	l := b.rootLock("kernel-" + key)
	l.Lock()
	defer l.Unlock()
	if k, err := loadBootKernel(dir); err == nil {
		return k, nil
	}
	if data, err := os.ReadFile(filepath.Join(dir, noKernelFile)); err == nil && string(data) == "none" {
		return b.qemu.nodeKernel(), nil
	}
	tree, done, err := b.mergeLayers(layers)
	if err != nil {
		return nil, err
	}
	defer done()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	kernel, release := findImageKernel(tree)
	if kernel == "" {
		return b.qemu.nodeKernel(), os.WriteFile(filepath.Join(dir, noKernelFile), []byte("none"), 0o600)
	}
	k, err := takeImageKernel(ctx, tree, kernel, release, dir, append(append([]string{}, imageKernelModules...), b.qemu.moduleOrder()...), NetModules)
	if err != nil {
		return nil, fmt.Errorf("%s: the image's kernel %s: %w", b.name, release, err)
	}
	b.log.Info("the image's own kernel taken for its guests", "release", release, "modules", len(k.OrderNet))
	return k, nil
}

// imageKernelModules are loaded before the node kernel's list for an
// image's kernel, which (as distributions build them) may have as modules
// what the node's has built in: the root and writable disks' ext4, and
// the checksum it asks the crypto API for.
var imageKernelModules = []string{"crc32c_generic", "crc32c_intel", "ext4"}

const (
	kernelFile   = "kernel.json"
	noKernelFile = "none"
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

// findImageKernel is the image's newest /boot/vmlinuz-RELEASE that has
// its modules directory, or "": regular files and directories only, no
// link followed out of the tree.
func findImageKernel(tree string) (path, release string) {
	if fi, err := os.Lstat(filepath.Join(tree, "boot")); err != nil || !fi.IsDir() {
		return "", ""
	}
	ents, _ := os.ReadDir(filepath.Join(tree, "boot"))
	var releases []string
	for _, e := range ents {
		rel, ok := strings.CutPrefix(e.Name(), "vmlinuz-")
		if !ok || !e.Type().IsRegular() || rel == "" || strings.ContainsAny(rel, "/") {
			continue
		}
		if modulesDirOf(tree, rel) != "" {
			releases = append(releases, rel)
		}
	}
	if len(releases) == 0 {
		return "", ""
	}
	slices.Sort(releases)
	rel := releases[len(releases)-1]
	return filepath.Join(tree, "boot", "vmlinuz-"+rel), rel
}

// modulesDirOf is the tree's modules directory of release ("" if none):
// usr/lib/modules (merged /usr), or lib/modules where lib is a directory.
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
			return p
		}
	}
	return ""
}

// maxModuleBytes bounds one decompressed module (the largest of a
// distribution's kernel are a few MiB): an image's file cannot fill the
// node's disk.
const maxModuleBytes = 64 << 20

// takeImageKernel copies kernel into dir and the modules of want and
// wantNet (and theirs, by the image's modules.dep) into dir/modules,
// decompressed, and writes dir's kernel.json.
func takeImageKernel(ctx context.Context, tree, kernel, release, dir string, want, wantNet []string) (*bootKernel, error) {
	modDir := modulesDirOf(tree, release)
	deps, files, err := readModulesDep(filepath.Join(modDir, "modules.dep"))
	if err != nil {
		return nil, err
	}
	k := &bootKernel{Path: filepath.Join(dir, "vmlinuz"), Image: true, ModulesDir: filepath.Join(dir, "modules")}
	k.Order = loadOrder(want, deps, files)
	k.OrderNet = loadOrder(append(append([]string{}, want...), wantNet...), deps, files)
	if err := os.MkdirAll(k.ModulesDir, 0o700); err != nil {
		return nil, err
	}
	for _, m := range k.OrderNet {
		if err := decompressModule(ctx, filepath.Join(modDir, files[m]), filepath.Join(k.ModulesDir, m+".ko")); err != nil {
			return nil, fmt.Errorf("module %s: %w", m, err)
		}
	}
	if err := copyRegular(ctx, kernel, k.Path); err != nil {
		return nil, err
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

// readModulesDep parses depmod's modules.dep: each module's dependencies
// by name (modprobe loads them last first) and its file, relative to the
// modules directory. Files outside it are refused.
func readModulesDep(path string) (deps map[string][]string, files map[string]string, err error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	deps, files = map[string][]string{}, map[string]string{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		file, rest, ok := strings.Cut(sc.Text(), ":")
		if !ok || !filepath.IsLocal(file) {
			continue
		}
		name := moduleName(file)
		files[name] = file
		for _, d := range strings.Fields(rest) {
			deps[name] = append(deps[name], moduleName(d))
		}
	}
	return deps, files, sc.Err()
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

// decompressModule writes src (a .ko, or .ko.xz/.zst/.gz) to dst as a
// plain module, at most maxModuleBytes.
func decompressModule(ctx context.Context, src, dst string) error {
	if fi, err := os.Lstat(src); err != nil || !fi.Mode().IsRegular() {
		return fmt.Errorf("%s: not a regular file", src)
	}
	var tool string
	switch filepath.Ext(src) {
	case ".ko":
		return copyRegular(ctx, src, dst)
	case ".xz":
		tool = "xz"
	case ".zst":
		tool = "zstd"
	case ".gz":
		tool = "gzip"
	default:
		return fmt.Errorf("%s: unknown compression", src)
	}
	cmd := exec.CommandContext(ctx, tool, "-dc", src)
	out, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("%s: %w (Debian's %s package)", tool, err, map[string]string{"xz": "xz-utils", "zstd": "zstd", "gzip": "gzip"}[tool])
	}
	w, err := os.OpenFile(dst, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		cmd.Process.Kill() //nolint:errcheck // reporting err
		cmd.Wait()         //nolint:errcheck // reporting err
		return err
	}
	n, err := io.Copy(w, io.LimitReader(out, maxModuleBytes+1))
	w.Close()
	if n > maxModuleBytes {
		cmd.Process.Kill() //nolint:errcheck // refused
		cmd.Wait()         //nolint:errcheck // refused
		return fmt.Errorf("%s: more than %d bytes decompressed", src, maxModuleBytes)
	}
	if werr := cmd.Wait(); werr != nil {
		return fmt.Errorf("%s -dc %s: %v: %s", tool, src, werr, strings.TrimSpace(stderr.String()))
	}
	return err
}

// copyRegular copies src, which must be a regular file, to dst (made
// anew).
func copyRegular(ctx context.Context, src, dst string) error {
	fi, err := os.Lstat(src)
	if err != nil {
		return err
	}
	if !fi.Mode().IsRegular() {
		return errors.New(src + ": not a regular file")
	}
	if err := os.Remove(dst); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return sparsefile.Copy(ctx, src, dst, 1)
}
