package layerfs

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/opendsec/internal/testutil"
)

func open(t *testing.T, warm int) *FS {
	t.Helper()
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "mkfs.ext4")
	f, err := Open(Config{Dir: filepath.Join(t.TempDir(), "layers"), WarmMB: 64, Warm: warm}, testutil.Logger(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Close)
	f.Start()
	return f
}

// fill writes 1 MiB chunks until an error, and returns what it wrote.
func fill(t *testing.T, path string, most int) (int, error) {
	t.Helper()
	w, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	chunk := bytes.Repeat([]byte("x"), 1<<20)
	written := 0
	for i := 0; i < most; i++ {
		n, err := w.Write(chunk)
		written += n
		if err != nil {
			return written, err
		}
	}
	return written, w.Sync()
}

// A layer holds its size and no more: the write past it fails with ENOSPC,
// statfs shows the size, another layer is not affected, and removal frees
// the node's disk.
func TestLayerIsBoundedAndRemovable(t *testing.T) {
	f := open(t, 0)
	ctx := context.Background()
	a, err := f.Create(ctx, 32)
	if err != nil {
		t.Fatal(err)
	}
	b, err := f.Create(ctx, 64)
	if err != nil {
		t.Fatal(err)
	}
	sub := filepath.Join(a, "upper", "deep")
	if err := os.MkdirAll(sub, 0o755); err != nil {
		t.Fatal(err)
	}
	written, err := fill(t, filepath.Join(sub, "fill"), 64)
	if !errors.Is(err, syscall.ENOSPC) || written > 32<<20 || written < 24<<20 {
		t.Fatalf("wrote %d bytes into a 32 MiB layer, then %v; want ENOSPC near 32 MiB", written, err)
	}
	// File system metadata takes a little of the size.
	if used, size, err := Usage(sub); err != nil || size > 32<<20 || size < 30<<20 || used < 24<<20 {
		t.Fatalf("statfs in the layer: %d of %d, %v", used, size, err)
	}
	if _, err := fill(t, filepath.Join(b, "ok"), 8); err != nil {
		t.Fatalf("the other layer: %v", err)
	}
	var st unix.Stat_t
	if err := unix.Stat(a+".img", &st); err != nil || st.Blocks*512 < 24<<20 {
		t.Fatalf("image of the full layer takes %d bytes, %v", st.Blocks*512, err)
	}
	if err := f.Remove(a); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{a, a + ".img"} {
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Fatalf("%s left after remove: %v", p, err)
		}
	}
	if err := f.Remove(a); err != nil {
		t.Fatalf("second remove: %v", err)
	}
	if got := f.Layers(); len(got) != 1 || got[0] != b {
		t.Fatalf("layers %v, want only %s", got, b)
	}
	if err := f.Remove(b); err != nil {
		t.Fatal(err)
	}
}

// Layers of one size are copies of one template, formatted once: each is
// its own empty file system (what one holds the other does not), the
// template stays small and sparse, and the next start removes templates
// and half-made ones with the other strays.
func TestLayersOfASizeShareOneTemplate(t *testing.T) {
	f := open(t, 0)
	ctx := context.Background()
	a, err := f.Create(ctx, 40)
	if err != nil {
		t.Fatal(err)
	}
	tmpl, _ := filepath.Glob(filepath.Join(f.dir, templatePrefix+"*"))
	var st unix.Stat_t
	if len(tmpl) != 1 || unix.Stat(tmpl[0], &st) != nil || st.Size != 40<<20 || st.Blocks*512 > 4<<20 {
		t.Fatalf("templates after one 40 MiB layer: %v (size %d, %d bytes on disk)", tmpl, st.Size, st.Blocks*512)
	}
	before := st.Mtim
	b, err := f.Create(ctx, 40)
	if err != nil {
		t.Fatal(err)
	}
	if unix.Stat(tmpl[0], &st) != nil || st.Mtim != before {
		t.Fatal("the template was formatted again for the second layer")
	}
	if err := os.WriteFile(filepath.Join(a, "only-in-a"), []byte("a"), 0o644); err != nil {
		t.Fatal(err)
	}
	ents, err := os.ReadDir(b)
	if err != nil || len(ents) != 0 {
		t.Fatalf("the second layer holds %v (%v); want it empty", ents, err)
	}
	if _, size, err := Usage(b); err != nil || size > 40<<20 || size < 36<<20 {
		t.Fatalf("statfs of the copy: size %d, %v", size, err)
	}
	for _, l := range []string{a, b} {
		if err := f.Remove(l); err != nil {
			t.Fatal(err)
		}
	}
	// As a node killed while formatting leaves them: the template and a
	// half-made one.
	if err := os.WriteFile(filepath.Join(f.dir, templatePrefix+"64.img.tmp"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Open(Config{Dir: f.dir}, testutil.Logger(t)); err != nil {
		t.Fatal(err)
	}
	if left, _ := filepath.Glob(filepath.Join(f.dir, templatePrefix+"*")); len(left) != 0 {
		t.Fatalf("templates left by a new start: %v", left)
	}
}

// Layers of the warm size come from the warm set, which refills; Close
// removes the unused ones.
func TestWarmLayers(t *testing.T) {
	f := open(t, 2)
	waitWarm := func(n int) {
		t.Helper()
		for i := 0; i < 500; i++ {
			f.mu.Lock()
			got := len(f.warm)
			f.mu.Unlock()
			if got >= n {
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
		t.Fatalf("warm set did not reach %d", n)
	}
	waitWarm(2)
	start := time.Now()
	l, err := f.Create(context.Background(), 64)
	if err != nil {
		t.Fatal(err)
	}
	took := time.Since(start)
	f.mu.Lock()
	left := len(f.warm)
	f.mu.Unlock()
	if left != 1 {
		t.Fatalf("layer %s did not come from the warm set (%d left in it)", l, left)
	}
	if got := f.Layers(); len(got) != 1 || got[0] != l {
		t.Fatalf("a taken layer is not listed as a sandbox's: %v", got)
	}
	t.Logf("a warm layer took %v", took)
	waitWarm(2)
	if err := f.Remove(l); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if ents, _ := os.ReadDir(f.dir); len(ents) != 0 {
		t.Fatalf("left after close: %v", ents)
	}
}

// Promised counts what the layers may still write: their sizes less what
// their images hold, warm layers aside, and it falls as a layer is written.
func TestPromisedFallsAsALayerIsWritten(t *testing.T) {
	f := open(t, 1)
	warmed := func() bool { f.mu.Lock(); defer f.mu.Unlock(); return len(f.warm) == 1 }
	for deadline := time.Now().Add(10 * time.Second); !warmed() && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond) // the warm layer is made and marked
	}
	if u, s := f.Promised(); u != 0 || s != 0 {
		t.Fatalf("with only a warm layer: promised %d of %d bytes, want none", u, s)
	}
	a, err := f.Create(context.Background(), 48)
	if err != nil {
		t.Fatal(err)
	}
	before, sizes := f.Promised()
	if sizes != 48<<20 || before <= 40<<20 || before > 48<<20 {
		t.Fatalf("a new 48 MiB layer: promised %d bytes of %d, want sizes 48 MiB and most of it unwritten", before, sizes)
	}
	if _, err := fill(t, filepath.Join(a, "data"), 16); err != nil {
		t.Fatal(err)
	}
	unix.Sync()
	after, _ := f.Promised()
	if before-after < 15<<20 {
		t.Fatalf("16 MiB written: promised went from %d to %d bytes, want it lower by about 16 MiB", before, after)
	}
	if err := f.Remove(a); err != nil {
		t.Fatal(err)
	}
	if u, s := f.Promised(); s != 0 || u != 0 {
		t.Fatalf("after removal: promised %d of %d bytes", u, s)
	}
}
