package microvm

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/sparsefile"
)

// Template snapshots [ours; docs/design.md, "microvm backend"]. A guest
// boots in seconds under TCG; a restore of a snapshot of a booted one
// takes a fraction of that, which is how E2B and its peers create every
// sandbox. The first create of an image and shape on a node (QEMU) boots
// a template guest with neutral settings (hostname dsec-template, no
// environment; a guest with a NIC on a TAP that leads nowhere), waits for
// its agent and snapshots it; that create and every later one of the same
// key restore the template: its RAM copied into a shared file of the
// sandbox's own (startFromTemplate says why not mapped), a sparse copy of
// its writable disk, and the sandbox's own identity, settings and network
// as its agent's first request (the edge sends them, Handle.Restored and
// Handle.Network). The sandbox's own initramfs is written too, for a
// later reboot. A template that does not restore is removed, the sandbox
// boots, and the next create builds the template again; a template of
// another QEMU, kernel, init or agent has another key.

// templateFormat is bumped when what a template holds changes.
const templateFormat = 1

// templateShape is what a template is made for: a create restores one
// only when all of it is equal.
type templateShape struct {
	Format int `json:"format"`
	// Root is the node's root disk of the image (named by its layers).
	Root     string `json:"root"`
	MemoryMB int    `json:"memory_mb"`
	SMP      int    `json:"smp"`
	DiskMB   int64  `json:"disk_mb"`
	Pids     int64  `json:"pids,omitempty"`
	NoFile   int64  `json:"nofile,omitempty"`
	Accel    string `json:"accel"`
	CPU      string `json:"cpu,omitempty"`
	// Net: the guest has a NIC (its copies take their own address in
	// their first request, as a fork's copies do).
	Net bool `json:"net,omitempty"`
	// Kernel is the image's own kernel its guests boot ("": the node's).
	Kernel string  `json:"kernel,omitempty"`
	Files  []stamp `json:"files"` // QEMU, the kernel, modules, init and agent as they were
}

// stamp is a file's identity as far as a template cares.
type stamp struct {
	Path  string `json:"path"`
	Size  int64  `json:"size"`
	MTime int64  `json:"mtime"`
}

func stampOf(path string) (stamp, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return stamp{}, err
	}
	return stamp{Path: path, Size: fi.Size(), MTime: fi.ModTime().UnixNano()}, nil
}

// key names the shape's template.
func (s templateShape) key() string {
	data, _ := json.Marshal(s)
	sum := sha256.Sum256(data)
	return hex.EncodeToString(sum[:12])
}

// templateShapeOf is the shape of a guest of spec on root disk root, and
// whether a template serves it.
func (b *Backend) templateShapeOf(spec *backend.Spec, root string, g Guest, diskMB int64) (templateShape, bool) {
	if !b.templatesOn || g.VMM != b.qemu.id() || len(spec.Devices) > 0 {
		// A guest with a host device boots: a template's copy would lack
		// it, and a device's state does not migrate.
		return templateShape{}, false
	}
	s := templateShape{Format: templateFormat, Root: root, MemoryMB: g.MemoryMB, SMP: max(g.SMP, 1), DiskMB: diskMB,
		Pids: spec.Pids, NoFile: spec.NoFile, Accel: g.Accel, CPU: g.CPU, Net: spec.NetNS != "", Kernel: g.Kernel}
	qemu, err := exec.LookPath(b.qemu.Binary)
	if err != nil {
		return s, false
	}
	// The root disk is named by its image's layers; its time is its last
	// use (PruneCache), which is no change.
	files := []string{qemu, b.qemu.Kernel, b.qemu.Modules, b.qemu.Init, spec.AgentPath}
	if b.qemu.ModulesDisk != "" {
		files = append(files, b.qemu.ModulesDisk)
	}
	if g.Kernel != "" {
		files = append(files, g.Kernel)
	}
	for _, p := range files {
		st, err := stampOf(p)
		if err != nil {
			return s, false
		}
		s.Files = append(s.Files, st)
	}
	return s, true
}

// templates are the node's template snapshots, under StateDir/templates:
// KEY/ (state, mem, rw.ext4, initrd.cpio, root.ext4, guest.json, shape.json
// and, last, ready) and .build-KEY/ while one is made.
type templates struct {
	dir string
	q   *QEMU
	log *slog.Logger

	mu     sync.Mutex
	locks  map[string]*sync.Mutex // guarded by mu: one per key being made or used
	failed map[string]time.Time   // guarded by mu: keys whose build failed, and when
}

// retryFailedBuild is how long a key whose template failed to build is
// booted without trying again.
const retryFailedBuild = 10 * time.Minute

func newTemplates(dir string, q *QEMU, log *slog.Logger) (*templates, error) {
	t := &templates{dir: dir, q: q, log: log, locks: map[string]*sync.Mutex{}, failed: map[string]time.Time{}}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	t.removeUnfinished()
	return t, nil
}

// removeUnfinished removes the builds a crash cut (their QEMU died with
// the edge: it runs with PDEATHSIG) and their guest RAM.
func (t *templates) removeUnfinished() {
	ents, _ := os.ReadDir(t.dir)
	for _, ent := range ents {
		if strings.HasPrefix(ent.Name(), ".build-") || strings.HasPrefix(ent.Name(), ".gone-") {
			build := filepath.Join(t.dir, ent.Name())
			os.Remove(buildMemFile(build))                              //nolint:errcheck // may not exist
			exec.Command("ip", "netns", "del", buildNetNS(build)).Run() //nolint:errcheck // most builds have none
			if err := os.RemoveAll(build); err != nil {
				t.log.Warn("unfinished template left", "dir", build, "err", err)
			}
		}
	}
}

func (t *templates) lock(key string) *sync.Mutex {
	t.mu.Lock()
	defer t.mu.Unlock()
	l := t.locks[key]
	if l == nil {
		l = &sync.Mutex{}
		t.locks[key] = l
	}
	return l
}

// ready says whether shape's template is there, whole.
func (t *templates) ready(s templateShape) bool {
	_, err := os.Stat(filepath.Join(t.dir, s.key(), "ready"))
	return err == nil
}

// get returns the directory of shape's template, built first if there is
// none (creates of one key wait for one build, whose guest has wait to
// answer), or why there is none now (its build failed, now or lately):
// the caller boots.
func (t *templates) get(ctx context.Context, s templateShape, agentPath string, wait time.Duration) (string, error) {
	key := s.key()
	l := t.lock(key)
	l.Lock()
	defer l.Unlock()
	dir := filepath.Join(t.dir, key)
	if _, err := os.Stat(filepath.Join(dir, "ready")); err == nil {
		now := time.Now()
		os.Chtimes(filepath.Join(dir, "ready"), now, now) //nolint:errcheck // its last use, for pruning
		return dir, nil
	}
	t.mu.Lock()
	failed, ok := t.failed[key]
	t.mu.Unlock()
	if ok && time.Since(failed) < retryFailedBuild {
		return "", fmt.Errorf("its build failed %s ago; the next try is after %s (the node's log says why)", time.Since(failed).Round(time.Second), retryFailedBuild)
	}
	began := time.Now()
	// The build outlives a create whose caller gave up: the next create
	// of the key would only start it again.
	if err := t.build(context.WithoutCancel(ctx), s, agentPath, dir, wait); err != nil {
		t.mu.Lock()
		t.failed[key] = time.Now()
		t.mu.Unlock()
		t.log.Warn("template snapshot not built; sandboxes of this image and shape boot", "template", key, "err", err)
		return "", err
	}
	t.log.Info("template snapshot built", "template", key, "took", time.Since(began).Round(time.Millisecond))
	return dir, nil
}

// discard removes a template that did not restore (why): the next create
// of its key builds it again.
func (t *templates) discard(dir string, why error) {
	t.log.Warn("template snapshot removed: it did not restore", "template", filepath.Base(dir), "err", why)
	gone := filepath.Join(t.dir, ".gone-"+filepath.Base(dir))
	if err := os.Rename(dir, gone); err != nil {
		return
	}
	os.RemoveAll(gone) //nolint:errcheck // removed again at the next start
}

// prune removes the templates no create used within grace.
func (t *templates) prune(grace time.Duration) (int64, error) {
	if t == nil {
		return 0, nil
	}
	ents, err := os.ReadDir(t.dir)
	if err != nil {
		return 0, err
	}
	var freed int64
	var errs []error
	for _, ent := range ents {
		if !ent.IsDir() || strings.HasPrefix(ent.Name(), ".") {
			continue
		}
		l := t.lock(ent.Name())
		l.Lock()
		dir := filepath.Join(t.dir, ent.Name())
		if fi, err := os.Stat(filepath.Join(dir, "ready")); err == nil && time.Since(fi.ModTime()) >= grace {
			n := allocated(dir) - fileBlocks(filepath.Join(dir, "root.ext4")) // the root disk is a link, counted where it is pruned
			if err := os.RemoveAll(dir); err != nil {
				errs = append(errs, err)
			} else {
				freed += n
				t.log.Info("template snapshot pruned", "template", ent.Name(), "bytes", n)
			}
		}
		l.Unlock()
	}
	return freed, errors.Join(errs...)
}

// templatesOption reads the templates option: on (the default) or off.
func templatesOption(v string) (bool, error) {
	switch v {
	case "", "on":
		return true, nil
	case "off":
		return false, nil
	}
	return false, errdefs.InvalidArgument("microvm backend: option templates %q: want on or off", errdefs.Clip(v, 40))
}

// writableDisk makes the writable disk of g, a new guest of spec: a copy
// of its template's, if a template serves it (g.Template then names it),
// else an empty file system of diskMB.
func (b *Backend) writableDisk(ctx context.Context, spec *backend.Spec, g *Guest, diskMB int64) error {
	if shape, ok := b.templateShapeOf(spec, g.Root, *g, diskMB); ok {
		if dir, _ := b.tpl.get(ctx, shape, spec.AgentPath, b.templateWait()); dir != "" {
			err := sparsefile.Copy(ctx, filepath.Join(dir, "rw.ext4"), g.WritableDisk, 1)
			if err == nil {
				g.Template = dir
				return nil
			}
			b.log.Warn("template's disk not copied; the sandbox boots", "sandbox", spec.ID, "err", err)
		}
	}
	return NewWritableDisk(ctx, g.WritableDisk, diskMB)
}

// Warm implements backend.Warmer: the template snapshot of spec's image
// and shape, with a NIC if network, built now unless the node has it.
func (b *Backend) Warm(ctx context.Context, spec *backend.Spec, network bool) (bool, error) {
	if len(spec.Layers) == 0 {
		return false, errdefs.InvalidArgument("microvm: the image has no layers")
	}
	root, err := b.rootImage(ctx, spec.Layers)
	if err != nil {
		return false, err
	}
	g := b.shapeOf(spec, b.booting().id())
	kernel, err := b.kernelFor(ctx, spec.Layers)
	if err != nil {
		return false, err
	}
	if kernel.Image {
		g.Kernel = kernel.Path
	}
	shape, ok := b.templateShapeOf(spec, root, g, diskOf(spec))
	if !ok {
		return false, errdefs.FailedPrecondition("microvm: this node makes no template snapshots (option templates=off, or its guests run on Firecracker): every create boots")
	}
	shape.Net = network
	had := b.tpl.ready(shape)
	if _, err := b.tpl.get(ctx, shape, spec.AgentPath, b.templateWait()); err != nil {
		return false, errdefs.Wrap(errdefs.ErrUnavailable, err, "microvm: the template snapshot of this image and shape")
	}
	return !had, nil
}

// templateWait is how long a template guest has to answer.
func (b *Backend) templateWait() time.Duration {
	if b.Accel() == "tcg" && b.probe != nil {
		return tcgAgentWait(b.probe.Boot)
	}
	return 2 * time.Minute
}

// startFromTemplate starts g, a new guest, by restoring its template, with
// the template's initramfs (QEMU checks the devices' state against its
// own; g's own is made if it boots: bootinitrd.go). A
// guest that does not restore boots; its template is removed when the
// fault is the template's (templateFault).
//
// Its RAM is a shared file of its own, a copy of the template's (the
// touched pages only), not a private mapping of the template's: its
// snapshots then leave RAM in that file, which keeps a fork's pause at
// milliseconds (a private mapping's RAM has to go through QEMU's stream:
// 963 ms against 70 ms paused, and forked copies of 3x the memory). Its
// guest then is as a booted one.
func (b *Backend) startFromTemplate(ctx context.Context, bx *box, g Guest) error {
	tpl := g.Template
	g.Template = ""
	began := time.Now()
	_, err := os.Stat(filepath.Join(tpl, "mem")) // a template's RAM is never in its stream
	if err == nil {
		err = b.restoreOwnRAM(ctx, bx, g, backend.SnapshotRef{Dir: tpl})
	}
	if err == nil {
		b.log.Debug("restored from template", "template", filepath.Base(tpl), "took", time.Since(began))
		return bx.saveGuest(g)
	}
	if ctx.Err() != nil {
		return err
	}
	if templateFault(err) {
		b.tpl.discard(tpl, err)
	} else {
		b.log.Warn("not restored from its template; the sandbox boots", "dir", bx.Dir, "template", filepath.Base(tpl), "err", err)
	}
	if err := bx.saveGuest(g); err != nil {
		return err
	}
	return b.launch(ctx, bx, g)
}

// templateFault says whether err, a failed restore of a template, is the
// template's fault: its state did not load or one of its files is gone.
// Anything else (QEMU did not start, the host refused a limit) leaves the
// template to the next create: under a burst, one sandbox's trouble would
// otherwise have every other create build it again.
func templateFault(err error) bool {
	var load *loadError
	return errors.As(err, &load) || errors.Is(err, fs.ErrNotExist)
}

// fileBlocks is the disk space one file takes.
func fileBlocks(path string) int64 {
	var st syscall.Stat_t
	if syscall.Stat(path, &st) != nil {
		return 0
	}
	return st.Blocks * 512
}

var _ backend.Warmer = (*Backend)(nil)
