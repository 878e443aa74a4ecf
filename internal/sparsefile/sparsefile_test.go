package sparsefile

import (
	"bytes"
	"context"
	"math/rand/v2"
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

// A sparse file (a guest's RAM or disk) copies to the same bytes, in one
// piece or several, and its holes stay holes.
func TestCopyFileKeepsDataAndHoles(t *testing.T) {
	for _, dir := range []string{t.TempDir(), "/dev/shm"} {
		src := filepath.Join(dir, "dsec-copyfile-src")
		defer os.Remove(src)
		f, err := os.Create(src)
		if err != nil {
			t.Fatal(err)
		}
		size := int64(64 << 20)
		f.Truncate(size)
		rng := rand.New(rand.NewPCG(1, 2))
		for _, off := range []int64{0, 5 << 20, 5<<20 + 4096, 31 << 20, size - 8192} {
			buf := make([]byte, 8192)
			for i := range buf {
				buf[i] = byte(rng.IntN(256))
			}
			f.WriteAt(buf, off)
		}
		f.Close()
		want, _ := os.ReadFile(src)
		for _, parts := range []int{1, 2, 3} {
			dst := filepath.Join(t.TempDir(), "dst")
			if err := Copy(context.Background(), src, dst, parts); err != nil {
				t.Fatal(err)
			}
			got, _ := os.ReadFile(dst)
			if !bytes.Equal(got, want) {
				t.Fatalf("%s, %d parts: the copy differs", dir, parts)
			}
			var st syscall.Stat_t
			syscall.Stat(dst, &st)
			if st.Blocks*512 > 1<<20 {
				t.Fatalf("%s, %d parts: the copy takes %d bytes: holes were filled", dir, parts, st.Blocks*512)
			}
		}
	}
}

func TestSplitCoversEveryByteOnce(t *testing.T) {
	extents := []extent{{0, 10}, {100, 7}, {200, 1}, {300, 30}}
	for n := 1; n <= 6; n++ {
		seen := map[int64]int{}
		for _, piece := range split(extents, n) {
			for _, e := range piece {
				for b := e.off; b < e.off+e.len; b++ {
					seen[b]++
				}
			}
		}
		total := 0
		for _, e := range extents {
			for b := e.off; b < e.off+e.len; b++ {
				if seen[b] != 1 {
					t.Fatalf("n=%d: byte %d copied %d times", n, b, seen[b])
				}
				total++
			}
		}
		if len(seen) != total {
			t.Fatalf("n=%d: %d bytes copied, want %d", n, len(seen), total)
		}
	}
}

// Prepare gives the file its size at once and its data at fill.
func TestPrepareSizesThenFills(t *testing.T) {
	dir := t.TempDir()
	src, dst := filepath.Join(dir, "src"), filepath.Join(dir, "dst")
	data := append(make([]byte, 1<<20), []byte("tail")...)
	if err := os.WriteFile(src, data, 0o600); err != nil {
		t.Fatal(err)
	}
	fill, err := Prepare(src, dst)
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(dst); err != nil || fi.Size() != int64(len(data)) {
		t.Fatalf("before fill: %v, %v; want %d bytes", fi, err, len(data))
	}
	if err := fill(context.Background(), 2); err != nil {
		t.Fatal(err)
	}
	if got, _ := os.ReadFile(dst); !bytes.Equal(got, data) {
		t.Fatal("after fill the file differs from its source")
	}
	if _, err := Prepare(filepath.Join(dir, "none"), dst); err == nil {
		t.Fatal("Prepare of a missing source did not fail")
	}
}

// Blocks of zeros become holes; blocks with data (even one byte) stay,
// and the file reads the same.
func TestPunchZerosKeepsTheData(t *testing.T) {
	for _, dir := range []string{t.TempDir(), "/dev/shm"} {
		path := filepath.Join(dir, "dsec-punch")
		defer os.Remove(path)
		const block, blocks = 4096, 1024 // 4 MiB, written whole
		want := make([]byte, block*blocks)
		rng := rand.New(rand.NewPCG(3, 4))
		data := map[int]bool{0: true, 1: true, 7: true, 300: true, 301: true, blocks - 1: true}
		for b := range data {
			for i := 0; i < block; i += 1 + rng.IntN(512) {
				want[b*block+i] = byte(1 + rng.IntN(255))
			}
		}
		want[500*block+block-1] = 9 // a block with a single byte at its end
		data[500] = true
		if err := os.WriteFile(path, want, 0o600); err != nil {
			t.Fatal(err)
		}
		freed, err := PunchZeros(context.Background(), path)
		if err != nil {
			t.Fatal(err)
		}
		if freed != int64(blocks-len(data))*block {
			t.Errorf("%s: freed %d bytes, want %d", dir, freed, (blocks-len(data))*block)
		}
		got, err := os.ReadFile(path)
		if err != nil || !bytes.Equal(got, want) {
			t.Fatalf("%s: the file reads differently after the punch (%v)", dir, err)
		}
		var st syscall.Stat_t
		if err := syscall.Stat(path, &st); err != nil {
			t.Fatal(err)
		}
		if used := st.Blocks * 512; used > int64(len(data)+16)*block {
			t.Errorf("%s: %d bytes still allocated for %d blocks of data", dir, used, len(data))
		}
		if again, err := PunchZeros(context.Background(), path); err != nil || again != 0 {
			t.Errorf("%s: a second punch freed %d (%v)", dir, again, err)
		}
	}
}
