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
