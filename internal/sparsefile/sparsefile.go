// Package sparsefile copies files that are mostly holes (a guest's RAM,
// disk images, empty file systems) in the kernel, only where they hold
// data, and reflinks them where the file system can.
package sparsefile

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// Copy copies src to dst (made anew) in the kernel, only the parts of src
// that hold data, in parts parallel pieces (a microVM snapshot copies while
// its source is stopped, so this is the source's pause). A reflink is used
// where the file system has them (dst then shares src's blocks until
// written).
func Copy(ctx context.Context, src, dst string, parts int) error {
	fill, err := Prepare(src, dst)
	if err != nil {
		return err
	}
	if err := fill(ctx, parts); err != nil {
		os.Remove(dst)
		return err
	}
	return nil
}

// Prepare makes dst (anew) as large as src and returns fill, which copies
// src's data into it as Copy does and closes both files: for a reader that
// opens dst before its data arrive (a VMM that maps a guest's RAM at its
// start and reads it only later). A fill that fails leaves dst to the
// caller.
func Prepare(src, dst string) (fill func(ctx context.Context, parts int) error, err error) {
	in, err := os.Open(src)
	if err != nil {
		return nil, err
	}
	fi, err := in.Stat()
	var out *os.File
	if err == nil {
		out, err = os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
		if err == nil {
			if err = out.Truncate(fi.Size()); err != nil {
				out.Close()
				os.Remove(dst)
			}
		}
	}
	if err != nil {
		in.Close()
		return nil, fmt.Errorf("copy %s: %w", src, err)
	}
	return func(ctx context.Context, parts int) error {
		defer in.Close()
		err := copyInto(ctx, in, out, fi.Size(), parts)
		if cerr := out.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return fmt.Errorf("copy %s: %w", src, err)
		}
		return nil
	}, nil
}

func copyInto(ctx context.Context, in, out *os.File, size int64, parts int) error {
	if err := out.Truncate(size); err != nil {
		return err
	}
	if unix.IoctlFileClone(int(out.Fd()), int(in.Fd())) == nil {
		return nil
	}
	extents, err := dataExtents(in, size)
	if err != nil {
		return err
	}
	pieces := split(extents, max(parts, 1))
	errs := make([]error, len(pieces))
	var wg sync.WaitGroup
	for i, piece := range pieces {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for _, e := range piece {
				if err := copyRange(ctx, in, out, e.off, e.len); err != nil {
					errs[i] = err
					return
				}
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// extent is a run of data in a file.
type extent struct{ off, len int64 }

// dataExtents lists the runs of f that hold data (SEEK_DATA/SEEK_HOLE);
// a file system without them reports one run, the whole file.
func dataExtents(f *os.File, size int64) ([]extent, error) {
	var out []extent
	fd := int(f.Fd())
	for off := int64(0); off < size; {
		data, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // only a hole after off
		}
		if err != nil {
			return []extent{{0, size}}, nil
		}
		hole, err := unix.Seek(fd, data, unix.SEEK_HOLE)
		if err != nil {
			hole = size
		}
		out = append(out, extent{data, hole - data})
		off = hole
	}
	return out, nil
}

// split cuts extents into n pieces of about equal bytes.
func split(extents []extent, n int) [][]extent {
	var total int64
	for _, e := range extents {
		total += e.len
	}
	per := total/int64(n) + 1
	pieces := make([][]extent, 0, n)
	var cur []extent
	var curLen int64
	for _, e := range extents {
		for e.len > 0 {
			take := min(e.len, per-curLen)
			cur = append(cur, extent{e.off, take})
			curLen += take
			e.off += take
			e.len -= take
			if curLen == per {
				pieces = append(pieces, cur)
				cur, curLen = nil, 0
			}
		}
	}
	if len(cur) > 0 {
		pieces = append(pieces, cur)
	}
	return pieces
}

// copyRange copies n bytes at off from in to out at the same offset.
func copyRange(ctx context.Context, in, out *os.File, off, n int64) error {
	for n > 0 {
		if err := ctx.Err(); err != nil {
			return err
		}
		roff, woff := off, off
		c, err := unix.CopyFileRange(int(in.Fd()), &roff, int(out.Fd()), &woff, int(min(n, 64<<20)), 0)
		if err != nil {
			if errors.Is(err, unix.EXDEV) || errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOSYS) || errors.Is(err, unix.EOPNOTSUPP) {
				return copyRangeRW(in, out, off, n)
			}
			return err
		}
		if c == 0 {
			return io.ErrUnexpectedEOF
		}
		off += int64(c)
		n -= int64(c)
	}
	return nil
}

// copyRangeRW is copyRange through user space.
func copyRangeRW(in, out *os.File, off, n int64) error {
	_, err := io.Copy(io.NewOffsetWriter(out, off), io.NewSectionReader(in, off, n))
	return err
}

// CopyAll copies each {src, dst} pair at once, the first (the largest, a
// guest's RAM) in parts pieces.
func CopyAll(ctx context.Context, pairs [][2]string, parts int) error {
	errs := make([]error, len(pairs))
	var wg sync.WaitGroup
	for i, p := range pairs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			n := 1
			if i == 0 {
				n = parts
			}
			errs[i] = Copy(ctx, p[0], p[1], n)
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// LinkOrCopy makes dst name src's contents: a hard link for a file
// nothing writes (an initramfs), a copy across file systems.
func LinkOrCopy(ctx context.Context, src, dst string) error {
	if os.Link(src, dst) == nil {
		return nil
	}
	return Copy(ctx, src, dst, 1)
}

// PunchZeros turns the blocks of the file at path that hold only zeros
// into holes (as `fallocate --dig-holes` does), so copies of it skip them
// and it takes only the disk its data need; its contents read the same.
// It returns the bytes it freed. A file system without holes frees none.
func PunchZeros(ctx context.Context, path string) (int64, error) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return 0, err
	}
	extents, err := dataExtents(f, fi.Size())
	if err != nil {
		return 0, err
	}
	const block = 4096
	buf := make([]byte, 1<<20)
	var freed int64
	punch := func(off, n int64) error {
		if n == 0 {
			return nil
		}
		if err := unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, n); err != nil {
			return fmt.Errorf("punch %s: %w", path, err)
		}
		freed += n
		return nil
	}
	for _, e := range extents {
		zeroAt, zeroLen := e.off, int64(0) // the run of zero blocks being gathered
		for off := e.off; off < e.off+e.len; {
			if err := ctx.Err(); err != nil {
				return freed, err
			}
			n, err := f.ReadAt(buf[:min(int64(len(buf)), e.off+e.len-off)], off)
			if n == 0 && err != nil {
				return freed, err
			}
			for b := 0; b < n; b += block {
				blk := buf[b:min(b+block, n)]
				if allZero(blk) && len(blk) == block {
					if zeroLen == 0 {
						zeroAt = off + int64(b)
					}
					zeroLen += block
					continue
				}
				if err := punch(zeroAt, zeroLen); err != nil {
					return freed, err
				}
				zeroLen = 0
			}
			off += int64(n)
		}
		if err := punch(zeroAt, zeroLen); err != nil {
			return freed, err
		}
	}
	return freed, nil
}

// allZero says whether b holds only zeros.
func allZero(b []byte) bool {
	for len(b) >= 8 {
		if b[0]|b[1]|b[2]|b[3]|b[4]|b[5]|b[6]|b[7] != 0 {
			return false
		}
		b = b[8:]
	}
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}
