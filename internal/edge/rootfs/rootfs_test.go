package rootfs

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/opendsec/opendsec/internal/testutil"
)

func TestMountStacksLayersAndUnmountCleans(t *testing.T) {
	testutil.RequireRoot(t)
	dir := t.TempDir()
	low, high := filepath.Join(dir, "l1"), filepath.Join(dir, "l2")
	os.MkdirAll(low, 0o755)
	os.MkdirAll(high, 0o755)
	os.WriteFile(filepath.Join(low, "a"), []byte("low"), 0o644)
	os.WriteFile(filepath.Join(low, "b"), []byte("low"), 0o644)
	os.WriteFile(filepath.Join(high, "b"), []byte("high"), 0o644)
	l := LayoutIn(filepath.Join(dir, "sb"))
	if err := Mount([]string{low, high}, l); err != nil {
		t.Fatal(err)
	}
	defer Unmount(l.Target)
	read := func(p string) string { b, _ := os.ReadFile(filepath.Join(l.Target, p)); return string(b) }
	if own, err := HoldsOwnFileSystem(l.Target); !own || err != nil {
		t.Fatalf("the overlay at %s is not its own file system: %v %v", l.Target, own, err)
	}
	if own, _ := HoldsOwnFileSystem(l.Upper); own {
		t.Fatalf("a plain directory %s counts as its own file system", l.Upper)
	}
	if read("a") != "low" || read("b") != "high" {
		t.Fatalf("stacking order wrong: a=%q b=%q", read("a"), read("b"))
	}
	os.WriteFile(filepath.Join(l.Target, "c"), []byte("new"), 0o644)
	if _, err := os.Stat(filepath.Join(low, "c")); err == nil {
		t.Fatal("write reached a lower layer")
	}
	if _, err := os.Stat(filepath.Join(l.Upper, "c")); err != nil {
		t.Fatal("write not in the upper layer")
	}
	if err := Unmount(l.Target); err != nil {
		t.Fatal(err)
	}
	if m, _ := IsMounted(l.Target); m {
		t.Fatal("still mounted")
	}
	if err := Unmount(l.Target); err != nil {
		t.Fatalf("second unmount: %v", err)
	}
}

func TestUnescapeOctal(t *testing.T) {
	if got := unescapeOctal(`/a\040b\011c`); got != "/a b\tc" {
		t.Fatalf("got %q", got)
	}
}
