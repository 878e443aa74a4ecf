// Package layerfs gives each sandbox a writable layer of bounded size on the
// node's disk [ours]: a file system of its own, a sparse ext4 image of the
// sandbox's disk_mb, loop-mounted. A write past the size fails with ENOSPC
// inside the sandbox, `df /` there shows the size (overlayfs reports its
// upper layer's file system), and the node's disk gives at most that much.
// Mounted with discard, what a sandbox deletes goes back to the node.
//
// Project quotas would do the same on one shared file system, but this
// kernel has neither XFS quotas nor the quota format ext4 needs
// (CONFIG_XFS_QUOTA, CONFIG_QFMT_V2 are off). Each size is formatted once,
// into a template image; a layer is a sparse copy of its size's template
// (a 64 MiB one holds 376 KiB of data), where running mkfs.ext4 for every
// layer took 3 to 7 ms of CPU and read the node's whole mount table (two
// lines a sandbox) to see whether the image was mounted. A few layers of
// the common size are also made ahead of time (the warm set), so a create
// only takes one.
package layerfs

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/loopdev"
	"github.com/opendsec/opendsec/internal/sparsefile"
)

// Config says where layers live and which to keep ready.
type Config struct {
	// Dir holds each layer's image (<name>.img) and mount point (<name>/).
	Dir string
	// WarmMB is the size of the layers made ahead of time (usually the
	// default disk_mb); Warm is how many are kept ready (0: none).
	WarmMB int64
	Warm   int
}

// FS makes, mounts and removes layers.
type FS struct {
	dir  string
	mkfs string
	log  *slog.Logger

	templates sync.Map // size in MiB → *template

	mu     sync.Mutex
	warmMB int64
	warm   []string // guarded by mu; names of ready, unused layers of warmMB
	want   int

	refill    chan struct{}
	stop      chan struct{}
	done      chan struct{}
	closeOnce sync.Once
	startOnce sync.Once
}

// warmMark is the suffix of the empty file beside a layer made ahead of
// time: taking the layer deletes it, so a layer without one belongs to a
// sandbox (or to a create a crash cut short, which the edge removes).
const warmMark = ".warm"

// Open checks that layers can be made here (mkfs.ext4, loop devices) and
// removes what an earlier run left half made. Start begins keeping the warm
// set: only after the caller has removed the layers no sandbox owns (a warm
// layer still being made would look like one).
func Open(cfg Config, log *slog.Logger) (*FS, error) {
	mkfs, err := exec.LookPath("mkfs.ext4")
	if err != nil {
		return nil, errdefs.FailedPrecondition("writable layers: mkfs.ext4 not found; install Debian's e2fsprogs package")
	}
	if ctl, err := os.OpenFile("/dev/loop-control", os.O_RDWR, 0); err != nil {
		return nil, errdefs.FailedPrecondition("writable layers: loop devices unavailable (%v); they need the loop module and root", err)
	} else {
		ctl.Close()
	}
	if err := os.MkdirAll(cfg.Dir, 0o711); err != nil {
		return nil, err
	}
	f := &FS{
		dir: cfg.Dir, mkfs: mkfs, log: logging.OrDiscard(log).With(logging.Component, "layerfs"),
		warmMB: cfg.WarmMB, want: cfg.Warm,
		refill: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{}),
	}
	// Warm layers a previous run left are unused: start them afresh.
	for _, name := range f.names() {
		if f.isWarm(name) {
			if err := f.Remove(f.Path(name)); err != nil {
				f.log.Warn("remove a warm layer left by an earlier run", "name", name, logging.Error, err)
			}
		}
	}
	// Images and marks without a mount point: a crash between making the
	// image and its directory.
	strays, _ := filepath.Glob(filepath.Join(cfg.Dir, "*.img"))
	marks, _ := filepath.Glob(filepath.Join(cfg.Dir, "*"+warmMark))
	// Templates, and one a crash cut short, are formatted again when used.
	templates, _ := filepath.Glob(filepath.Join(cfg.Dir, templatePrefix+"*"))
	for _, p := range templates {
		os.Remove(p) //nolint:errcheck // best effort
	}
	for _, p := range append(strays, marks...) {
		base := strings.TrimSuffix(strings.TrimSuffix(p, ".img"), warmMark)
		if fi, err := os.Stat(base); err != nil || !fi.IsDir() {
			os.Remove(p) //nolint:errcheck // best effort
		}
	}
	return f, nil
}

// Start begins keeping the warm set.
func (f *FS) Start() {
	f.startOnce.Do(func() {
		go f.keepWarm()
		f.kick()
	})
}

// Close stops making warm layers and removes the unused ones and the
// templates. Sandboxes' layers stay mounted: the sandboxes outlive the
// edge.
func (f *FS) Close() {
	f.closeOnce.Do(func() {
		f.Start() // so that done is closed
		close(f.stop)
		<-f.done
		f.mu.Lock()
		warm := f.warm
		f.warm = nil
		f.mu.Unlock()
		for _, name := range warm {
			if err := f.Remove(f.Path(name)); err != nil {
				f.log.Warn("remove a warm layer", "name", name, logging.Error, err)
			}
		}
		f.templates.Range(func(_, v any) bool {
			t := v.(*template)
			t.mu.Lock()
			if t.path != "" {
				os.Remove(t.path) //nolint:errcheck // the next start removes it too
				t.path = ""
			}
			t.mu.Unlock()
			return true
		})
	})
}

func (f *FS) isWarm(name string) bool {
	_, err := os.Stat(f.Path(name) + warmMark)
	return err == nil
}

// Path is the mount point of the layer called name.
func (f *FS) Path(name string) string { return filepath.Join(f.dir, name) }

// Names lists the layers that exist, warm ones included.
func (f *FS) names() []string {
	ents, _ := os.ReadDir(f.dir)
	var out []string
	for _, e := range ents {
		if e.IsDir() {
			out = append(out, e.Name())
		}
	}
	return out
}

// Layers lists the mount points of sandboxes' layers (not the warm ones),
// so the edge can remove those no sandbox owns after a crash.
func (f *FS) Layers() []string {
	var out []string
	for _, n := range f.names() {
		if !f.isWarm(n) {
			out = append(out, f.Path(n))
		}
	}
	return out
}

// Create returns the mount point of a new, empty layer of sizeMB: a warm
// one if there is one of that size, else one made now.
func (f *FS) Create(ctx context.Context, sizeMB int64) (string, error) {
	f.mu.Lock()
	if sizeMB == f.warmMB && len(f.warm) > 0 {
		name := f.warm[len(f.warm)-1]
		f.warm = f.warm[:len(f.warm)-1]
		f.mu.Unlock()
		f.kick()
		if err := os.Remove(f.Path(name) + warmMark); err != nil {
			return "", err
		}
		return f.Path(name), nil
	}
	f.mu.Unlock()
	return f.make(ctx, randomName(), sizeMB, false)
}

// make copies its size's template into a new layer called name and
// mounts it. In the background a template is formatted at the lowest CPU
// priority, so a create is not slowed by the warm set's refill.
func (f *FS) make(ctx context.Context, name string, sizeMB int64, background bool) (string, error) {
	img := f.Path(name) + ".img"
	mnt := f.Path(name)
	fail := func(err error) (string, error) {
		unix.Unmount(mnt, unix.MNT_DETACH) //nolint:errcheck // cleaning up a half-made layer
		os.Remove(mnt)
		os.Remove(img)
		return "", err
	}
	tmpl, err := f.template(ctx, sizeMB, background)
	if err != nil {
		return "", err
	}
	if _, err := os.Stat(img); err == nil {
		return "", fmt.Errorf("writable layer %s: exists", img)
	}
	if err := sparsefile.Copy(ctx, tmpl, img, 1); err != nil {
		return fail(fmt.Errorf("writable layer: %w", err))
	}
	if err := os.Mkdir(mnt, 0o700); err != nil {
		return fail(err)
	}
	if err := loopMount(img, mnt); err != nil {
		return fail(err)
	}
	// The root of the new file system is the layer's directory; lost+found
	// is no part of a sandbox.
	os.Remove(filepath.Join(mnt, "lost+found"))
	return mnt, nil
}

// template is one per size: made on first use, removed with the node's
// strays at the next start (Open).
type template struct {
	mu   sync.Mutex
	path string // "" until made
}

// template returns the path of the formatted, empty image of sizeMB,
// formatting it the first time. A failed format is tried again on the next
// call.
func (f *FS) template(ctx context.Context, sizeMB int64, background bool) (string, error) {
	v, _ := f.templates.LoadOrStore(sizeMB, &template{})
	t := v.(*template)
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.path != "" {
		return t.path, nil
	}
	path := filepath.Join(f.dir, fmt.Sprintf("%s%d.img", templatePrefix, sizeMB))
	tmp := path + ".tmp"
	file, err := os.OpenFile(tmp, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return "", err
	}
	err = file.Truncate(sizeMB << 20) // sparse: blocks are taken as the sandbox writes
	file.Close()
	if err == nil {
		err = f.format(ctx, tmp, background)
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		os.Remove(tmp)
		return "", err
	}
	t.path = path
	return path, nil
}

// templatePrefix names template images; Open removes them with the other
// images no layer directory goes with.
const templatePrefix = ".template-"

// format makes an empty ext4 file system in img: no reserved blocks and no
// journal (a layer does not outlive a crash of its node in any useful way,
// and the journal would take up to 64 MiB of the sandbox's size); one inode
// per 16 KiB, enough for package trees; inode tables initialised lazily,
// so formatting writes little (376 KiB of a 64 MiB image).
func (f *FS) format(ctx context.Context, img string, background bool) error {
	cmd := exec.CommandContext(ctx, f.mkfs, "-q", "-F", "-m", "0", "-i", "16384", "-O", "^has_journal",
		"-E", "lazy_itable_init=1,nodiscard", img)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Start()
	if err == nil {
		if background {
			unix.Setpriority(unix.PRIO_PROCESS, cmd.Process.Pid, 19) //nolint:errcheck // only slower otherwise
		}
		err = cmd.Wait()
	}
	if err != nil {
		return fmt.Errorf("writable layer: mkfs.ext4: %w: %s", err, strings.TrimSpace(out.String()))
	}
	return nil
}

// Remove unmounts a layer and deletes it; removing one that does not exist
// succeeds.
func (f *FS) Remove(mnt string) error {
	if filepath.Dir(mnt) != f.dir {
		return fmt.Errorf("writable layer %s: not in %s", mnt, f.dir)
	}
	for i := 0; ; i++ {
		err := unix.Unmount(mnt, 0)
		if err == nil || errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT) {
			break
		}
		if !errors.Is(err, unix.EBUSY) || i == 20 {
			if err := unix.Unmount(mnt, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
				return fmt.Errorf("writable layer %s: unmount: %w", mnt, err)
			}
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := os.Remove(mnt); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("writable layer %s: %w", mnt, err)
	}
	if err := os.Remove(mnt + ".img"); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("writable layer %s: %w", mnt, err)
	}
	os.Remove(mnt + warmMark) //nolint:errcheck // only warm layers have one
	return nil
}

// Usage returns what a layer holds and its size, in bytes.
func Usage(mnt string) (used, size int64, err error) {
	var st unix.Statfs_t
	if err := unix.Statfs(mnt, &st); err != nil {
		return 0, 0, err
	}
	return int64(st.Blocks-st.Bfree) * st.Bsize, int64(st.Blocks) * st.Bsize, nil
}

// Promised is what the node's disk still owes the layers that exist (warm
// ones aside): each layer's size less what its image already takes, summed
// (unwritten), and the sizes themselves (sizes). A layer's image is sparse,
// so the disk must keep unwritten free or a sandbox writing its own layer
// finds the node's disk full and its neighbours' writes are lost.
func (f *FS) Promised() (unwritten, sizes int64) {
	for _, name := range f.names() {
		if f.isWarm(name) {
			continue
		}
		var st unix.Stat_t
		if unix.Stat(f.Path(name)+".img", &st) != nil {
			continue // removed meanwhile, or not made yet
		}
		sizes += st.Size
		unwritten += max(st.Size-st.Blocks*512, 0)
	}
	return unwritten, sizes
}

func (f *FS) kick() {
	select {
	case f.refill <- struct{}{}:
	default:
	}
}

// keepWarm makes layers until the warm set is full, whenever one is taken.
func (f *FS) keepWarm() {
	defer close(f.done)
	for {
		select {
		case <-f.stop:
			return
		case <-f.refill:
		}
		for {
			f.mu.Lock()
			short := f.want - len(f.warm)
			size := f.warmMB
			f.mu.Unlock()
			if short <= 0 || size <= 0 {
				break
			}
			select {
			case <-f.stop:
				return
			default:
			}
			// Marked before it is made: a layer being made for the warm
			// set is never listed as a sandbox's (Layers), nor counted as
			// promised. A mark left without its layer is removed by Open.
			name := randomName()
			if err := os.WriteFile(f.Path(name)+warmMark, nil, 0o600); err != nil {
				f.log.Warn("mark a warm layer", logging.Error, err)
				break
			}
			if _, err := f.make(context.Background(), name, size, true); err != nil {
				f.log.Warn("make a warm layer", logging.Error, err)
				os.Remove(f.Path(name) + warmMark) //nolint:errcheck // it was never made
				break
			}
			f.mu.Lock()
			f.warm = append(f.warm, name)
			f.mu.Unlock()
		}
	}
}

func randomName() string {
	b := make([]byte, 8)
	rand.Read(b) //nolint:errcheck // crypto/rand does not fail on Linux
	return hex.EncodeToString(b)
}

// loopMount attaches img to a free loop device (which detaches itself when
// unmounted) and mounts its ext4 file system at mnt.
func loopMount(img, mnt string) error {
	if err := loopdev.Mount(img, mnt, "ext4", unix.MS_NOATIME|unix.MS_NODEV|unix.MS_NOSUID, "discard,noinit_itable"); err != nil {
		return fmt.Errorf("writable layer: %w", err)
	}
	return nil
}
